"""Marker ops that Dynamo traces when a managed parameter is read.

``compiled_fsdp::unshard`` turns one parameter shard into the full parameter;
its backward is ``compiled_fsdp::reduce_grad``, which turns the full gradient
into the averaged gradient shard. Both have real (eager) implementations that
run correct per-parameter collectives, so any backend that does not run our
passes (e.g. ``backend="eager"``) still trains correctly; under
``aot_eager``/Inductor the joint pass (``compiled_fsdp.passes``) replaces them
with one bucketed collective per unit (a layer: see [Note: Units] in
passes/units.py).

``unshard`` reads this rank's ``local_rows`` rows (the DTensor's local tensor)
and ``reduce_grad`` returns the gradient of those rows; the padding to the
common shard shape happens inside, with the layout functions the eager runtime
and the lowering share ([Note: Bucket layout] in _layout.py). ``param_dtype``
and ``reduce_dtype`` are the parameter's mixed-precision dtypes ([Note: Mixed
precision] in _policy.py).

[Note: Accumulation without sync in graphs]
``sync`` and ``kept`` carry FSDP2's ``set_requires_gradient_sync`` into the
graph. The parameter property reads the flag while Dynamo traces, so Dynamo
guards on it (and on whether a gradient is kept): in an accumulation loop one
graph per flag value, no recompile when it flips back; a synced step with
nothing kept (one micro-batch per step, evaluation) is a third graph. The flag
takes effect at the forward, so it must not change before that forward's
backward (FSDP2 reads it in backward): the root checks this when the backward
starts and raises (``_RootContext.watch_compiled_backward``). A parameter that
does not require grad always has ``sync=True`` and nothing kept.

- ``sync=False``: ``kept`` is the parameter's *gradient sink*, a full-shape
  leaf with zero strides (one element of storage) that requires grad. The
  backward gives the shard no gradient and gives the sink the full gradient
  in ``reduce_dtype`` (``reduce_grad(sync=False)``, no communication), so
  autograd's own accumulation sums the micro-batches into ``sink.grad``,
  outside the graph, exactly as a reference's ``.grad`` is summed.
- ``sync=True`` after such micro-batches: ``kept`` is ``sink.grad``, which
  ``reduce_grad`` adds to this backward's gradient before the one
  reduce-scatter ([Note: Bucket layout]'s ``reduce_input``, shared with the
  eager runtime). When that forward's backward starts, the root drops the
  sink's reference (the graph's saved copy is freed by its backward); a
  forward whose backward never runs leaves it kept.
- ``sync=True`` with nothing kept: ``kept`` is None, the usual graph.

A parameter read twice has two markers with the same ``kept``. The lowering sums
their gradients and adds ``kept`` once per parameter; the markers' own eager
implementations (``backend="eager"``, or a module the lowering left alone) reduce
per read, so ``reduce_grad`` adds a given ``kept`` tensor only the first time it
sees it (``_ADDED``). Tested by tests/test_no_sync.py.

[Note: Local rows in the marker]
``local_rows`` is also the input's first dimension, and it is passed anyway:
the Dynamo graph is otherwise the same on every rank (its inputs are DTensors
of the same global shape), and AOTAutograd's cache keys a DTensor input by its
global spec only. Ranks sharing a cache directory (every rank of a host does)
would then load each other's compiled graphs, built for a different local
shape. With the row count in the graph, ranks holding different rows get
different keys, and ranks holding the same rows still share one compile.
Tested by tests/test_compile_parity.py::test_uneven_shards_share_no_cache_entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.collectives import count_collective, reduce_scatter_flat
from compiled_fsdp.runtime.divergence import COLLECTIVE, Checkpoint, stable_code
from compiled_fsdp.core.layout import (
    EAGER, ShardSpec, cast, pack_grads, pack_shards, reduce_input, split_reduced, split_specs,
    unpack_gathered,
)

__all__ = [
    "ENTRY_KEY", "NEXT_KEY", "UNSHARD_SCHEMA", "REDUCE_GRAD_SCHEMA", "GATHER_NEXT_SCHEMA",
    "REDUCE_NEXT_SCHEMA", "unshard", "reduce_grad", "gather_next", "reduce_next",
]

# Kept gradients an eager ``reduce_grad`` has already added (by identity); see
# [Note: Accumulation without sync in graphs].
_ADDED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# The ``module_key`` of a module compiled as its own frame (group keys count up
# from 0): see [Note: Blocks compiled on their own] in _param_group.py.
ENTRY_KEY = -1
# The ``module_key`` of the block whose gather a block's graph hands over (see
# [Note: Gathers handed to the next block's graph] in _param_group.py).
NEXT_KEY = -2

UNSHARD_SCHEMA = (
    "(Tensor shard, SymInt[] full_shape, str group_name, int world_size, "
    "int module_key, int param_index, int local_rows, bool reshard_after_forward, "
    "str? reduce_group_name=None, ScalarType? param_dtype=None, ScalarType? reduce_dtype=None, "
    "Tensor? kept=None, bool sync=True, bool outermost=False, Tensor? gathered=None, "
    "int bucket_offset=0, int bucket_numel=0) -> Tensor"
)
REDUCE_GRAD_SCHEMA = (
    "(Tensor grad, SymInt[] full_shape, str group_name, int world_size, "
    "int module_key, int param_index, int local_rows, ScalarType? reduce_dtype=None, "
    "ScalarType? grad_dtype=None, Tensor? kept=None, bool sync=True, int bucket_offset=0, "
    "int bucket_numel=0) -> Tensor"
)
# ``full_shapes``: the parameters' full shapes, concatenated (each has its
# shard's number of dimensions); ``ndims`` says how to cut them where the
# shards are not at hand. With ``sync``, ``kept`` holds each parameter's kept
# gradient (or None); without, ``sinks`` are the gradient sinks of the
# parameters ``sink_params`` (those that require grad).
GATHER_NEXT_SCHEMA = (
    "(Tensor[] shards, Tensor?[] kept, Tensor[] sinks, int[] sink_params, int[] full_shapes, "
    "int[] local_rows, str group_name, "
    "int world_size, int module_key, str? reduce_group_name, ScalarType? param_dtype, "
    "ScalarType? reduce_dtype, bool sync) -> Tensor"
)
REDUCE_NEXT_SCHEMA = (
    "(Tensor grad, Tensor?[] kept, int[] full_shapes, int[] ndims, int[] local_rows, "
    "str group_name, int world_size, int module_key, ScalarType? reduce_dtype=None, "
    "ScalarType? grad_dtype=None, bool sync=True) -> Tensor[]"
)


def _spec(full_shape: Sequence[int], world_size: int) -> ShardSpec:
    return ShardSpec(tuple(full_shape), world_size)


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _check(op: str, module_key: int, param_index: int) -> None:
    """Agree on an unlowered marker's collective before issuing it; see [Note:
    Agreeing on collectives] in _divergence.py."""
    from compiled_fsdp.runtime.param_group import _GROUPS

    owner = _GROUPS.get(module_key)
    if owner is not None and owner.checker is not None:
        owner.checker.check(Checkpoint(
            COLLECTIVE, owner.checker.step, stable_code(op, owner.identity, param_index),
            f"the per-parameter {op} of {owner.label}'s parameter {param_index}"))


# ---------------------------------------------------------------------------
# unshard
# ---------------------------------------------------------------------------


def _fresh(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """``out``, copied if it shares ``inp``'s storage (a custom op must not
    return an alias of its input)."""
    same = out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    return out.clone() if same else out


@torch.library.custom_op("compiled_fsdp::unshard", mutates_args=(), schema=UNSHARD_SCHEMA)
def unshard(
    shard: torch.Tensor,
    full_shape: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    param_index: int,
    local_rows: int,
    reshard_after_forward: bool,
    reduce_group_name: Optional[str] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    kept: Optional[torch.Tensor] = None,
    sync: bool = True,
    outermost: bool = False,
    gathered: Optional[torch.Tensor] = None,
    bucket_offset: int = 0,
    bucket_numel: int = 0,
) -> torch.Tensor:
    specs = [_spec(full_shape, world_size)]
    if gathered is not None:  # handed over: see [Note: Gathers handed to the next block's graph]
        flat = torch.ops._c10d_functional.wait_tensor(gathered)
        return _fresh(unpack_gathered(EAGER, flat, specs, [bucket_offset], bucket_numel)[0], gathered)
    flat = pack_shards(EAGER, [shard], specs, [param_dtype])
    if world_size == 1:
        gathered = flat.clone()
    else:
        gathered = flat.new_empty(world_size * flat.numel())
        count_collective("unbucketed_all_gather")
        _check("all-gather", module_key, param_index)
        compat.all_gather_single(gathered, flat, group=_group(group_name))
    # custom ops must not return an alias of an input; `gathered` is fresh.
    return unpack_gathered(EAGER, gathered, specs)[0]


@unshard.register_fake
def _unshard_fake(
    shard: torch.Tensor,
    full_shape: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    param_index: int,
    local_rows: int,
    reshard_after_forward: bool,
    reduce_group_name: Optional[str] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    kept: Optional[torch.Tensor] = None,
    sync: bool = True,
    outermost: bool = False,
    gathered: Optional[torch.Tensor] = None,
    bucket_offset: int = 0,
    bucket_numel: int = 0,
) -> torch.Tensor:
    return shard.new_empty(list(full_shape), dtype=param_dtype or shard.dtype)


_UNSHARD_ARGS = [a.name for a in torch.ops.compiled_fsdp.unshard.default._schema.arguments]


def _unshard_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a = dict(zip(_UNSHARD_ARGS, inputs))
    # The gradient is reduced on the reduce group when there is one; see
    # [Note: A second group for reduce-scatters] in _api.py.
    ctx.args = (list(a["full_shape"]), a["reduce_group_name"] or a["group_name"], a["world_size"],
                a["module_key"], a["param_index"], a["local_rows"], a["reduce_dtype"], a["shard"].dtype)
    ctx.sync = a["sync"]
    ctx.kept = a["kept"] if ctx.sync else None  # see [Note: Accumulation without sync in graphs]
    # Read from a handed-over gather: its gradient goes back there, packed.
    ctx.handed = a["gathered"] is not None
    ctx.bucket = (a["bucket_offset"], a["bucket_numel"]) if ctx.handed else (0, 0)


def _unshard_backward(ctx, grad):  # type: ignore[no-untyped-def]
    offset, numel = ctx.bucket
    g = torch.ops.compiled_fsdp.reduce_grad(grad, *ctx.args, kept=ctx.kept, sync=ctx.sync,
                                            bucket_offset=offset, bucket_numel=numel)
    # The shard's gradient, or (without sync) the sink's, or the handed-over
    # gather's; none for the rest.
    receiver = "gathered" if ctx.handed else "shard" if ctx.sync else "kept"
    return tuple(g if name == receiver else None for name in _UNSHARD_ARGS)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# ---------------------------------------------------------------------------
# reduce_grad
# ---------------------------------------------------------------------------


@torch.library.custom_op(
    "compiled_fsdp::reduce_grad", mutates_args=(), schema=REDUCE_GRAD_SCHEMA
)
def reduce_grad(
    grad: torch.Tensor,
    full_shape: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    param_index: int,
    local_rows: int,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    kept: Optional[torch.Tensor] = None,
    sync: bool = True,
    bucket_offset: int = 0,
    bucket_numel: int = 0,
) -> torch.Tensor:
    specs = [_spec(full_shape, world_size)]
    if bucket_numel:  # the gradient of a handed-over gather: this parameter's columns
        return _fresh(pack_grads(EAGER, [grad], specs, [bucket_offset], bucket_numel), grad)
    if not sync:  # the full gradient for the sink; see [Note: Accumulation without sync in graphs]
        full = cast(EAGER, grad, reduce_dtype)
        return full.clone() if full is grad else full
    if kept is not None:  # added once, however many reads: see the note
        if kept in _ADDED:
            kept = None
        else:
            _ADDED[kept] = None
    flat = pack_grads(EAGER, [reduce_input(EAGER, grad, kept, reduce_dtype)], specs)
    if world_size == 1:
        summed = flat.clone()
    else:
        count_collective("unbucketed_reduce_scatter")
        _check("reduce-scatter", module_key, param_index)
        summed = reduce_scatter_flat(flat, _group(group_name), async_op=False).wait()
    # Sum then divide, cut to the local rows: the bucketed path's steps.
    return split_reduced(EAGER, summed, specs, [local_rows], [grad_dtype])[0]


@reduce_grad.register_fake
def _reduce_grad_fake(
    grad: torch.Tensor,
    full_shape: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    param_index: int,
    local_rows: int,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    kept: Optional[torch.Tensor] = None,
    sync: bool = True,
    bucket_offset: int = 0,
    bucket_numel: int = 0,
) -> torch.Tensor:
    if bucket_numel:
        return grad.new_empty([world_size * bucket_numel])
    if not sync:
        return grad.new_empty(list(full_shape), dtype=reduce_dtype or grad.dtype)
    return grad.new_empty([local_rows, *_spec(full_shape, world_size).rest], dtype=grad_dtype or grad.dtype)


# ---------------------------------------------------------------------------
# gather_next / reduce_next: see [Note: Gathers handed to the next block's graph]
# ---------------------------------------------------------------------------


@torch.library.custom_op("compiled_fsdp::gather_next", mutates_args=(), schema=GATHER_NEXT_SCHEMA)
def gather_next(
    shards: Sequence[torch.Tensor],
    kept: Sequence[Optional[torch.Tensor]],
    sinks: Sequence[torch.Tensor],
    sink_params: Sequence[int],
    full_shapes: Sequence[int],
    local_rows: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    reduce_group_name: Optional[str],
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    sync: bool,
) -> torch.Tensor:
    """One module's bucketed all-gather, returned *not waited*: whoever reads
    it waits (``unshard(gathered=...)``)."""
    specs = split_specs(full_shapes, [s.dim() for s in shards], world_size)
    flat = pack_shards(EAGER, list(shards), specs, [param_dtype] * len(specs))
    if world_size == 1:
        return flat.clone()
    count_collective("all_gather")
    _check("all-gather", module_key, -1)
    return torch.ops._c10d_functional.all_gather_into_tensor(flat, world_size, group_name)


@gather_next.register_fake
def _gather_next_fake(
    shards: Sequence[torch.Tensor],
    kept: Sequence[Optional[torch.Tensor]],
    sinks: Sequence[torch.Tensor],
    sink_params: Sequence[int],
    full_shapes: Sequence[int],
    local_rows: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    reduce_group_name: Optional[str],
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    sync: bool,
) -> torch.Tensor:
    specs = split_specs(full_shapes, [s.dim() for s in shards], world_size)
    total = sum(s.shard_numel for s in specs)
    return shards[0].new_empty([world_size * total], dtype=param_dtype or shards[0].dtype)


_GATHER_NEXT_ARGS = [a.name for a in torch.ops.compiled_fsdp.gather_next.default._schema.arguments]


def _gather_next_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a = dict(zip(_GATHER_NEXT_ARGS, inputs))
    shards = a["shards"]
    ctx.args = (list(a["full_shapes"]), [s.dim() for s in shards], list(a["local_rows"]),
                a["reduce_group_name"] or a["group_name"], a["world_size"], a["module_key"],
                a["reduce_dtype"], shards[0].dtype)
    ctx.sync = a["sync"]
    ctx.kept = list(a["kept"])
    ctx.sink_params = list(a["sink_params"])
    # Autograd wants a gradient of each input's structure: a list for a list
    # of tensors (an empty one too), None for anything else (a list with a
    # None in it is one opaque argument). (The schema has no defaults: a
    # trailing argument equal to its default would not count as an input.)
    ctx.lists = {name: len(v) for name, v in a.items()
                 if isinstance(v, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in v)}


def _gather_next_backward(ctx, grad):  # type: ignore[no-untyped-def]
    # With sync: the kept gradients are added and the sum reduced, the shards
    # get their part. Without: the sinks get the full gradients.
    grads = torch.ops.compiled_fsdp.reduce_next(
        grad, ctx.kept if ctx.sync else [], *ctx.args, sync=ctx.sync)
    given = {"shards": list(grads)} if ctx.sync else {"sinks": [grads[i] for i in ctx.sink_params]}
    return tuple(given.get(name, [None] * ctx.lists[name] if name in ctx.lists else None)
                 for name in _GATHER_NEXT_ARGS)


gather_next.register_autograd(_gather_next_backward, setup_context=_gather_next_setup_context)


@torch.library.custom_op("compiled_fsdp::reduce_next", mutates_args=(), schema=REDUCE_NEXT_SCHEMA)
def reduce_next(
    grad: torch.Tensor,
    kept: Sequence[Optional[torch.Tensor]],
    full_shapes: Sequence[int],
    ndims: Sequence[int],
    local_rows: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    sync: bool = True,
) -> list[torch.Tensor]:
    """The backward of ``gather_next``: ``grad`` is the full gradient of the
    whole bucket, in the gather's layout."""
    specs = split_specs(full_shapes, ndims, world_size)
    if not sync:  # the full gradients, for the sinks
        full = cast(EAGER, grad, reduce_dtype)
        return [f.clone() for f in unpack_gathered(EAGER, full, specs)]
    kept_flat = pack_grads(EAGER, list(kept), specs) if any(k is not None for k in kept) else None
    flat = reduce_input(EAGER, grad, kept_flat, reduce_dtype)
    if world_size == 1:
        summed = flat.clone()
    else:
        count_collective("reduce_scatter")
        _check("reduce-scatter", module_key, -1)
        summed = reduce_scatter_flat(flat, _group(group_name), async_op=False).wait()
    dtypes = [grad_dtype] * len(specs)
    return [g.clone() for g in split_reduced(EAGER, summed, specs, list(local_rows), dtypes)]


@reduce_next.register_fake
def _reduce_next_fake(
    grad: torch.Tensor,
    kept: Sequence[Optional[torch.Tensor]],
    full_shapes: Sequence[int],
    ndims: Sequence[int],
    local_rows: Sequence[int],
    group_name: str,
    world_size: int,
    module_key: int,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    sync: bool = True,
) -> list[torch.Tensor]:
    specs = split_specs(full_shapes, ndims, world_size)
    if not sync:
        return [grad.new_empty(list(s.full_shape), dtype=reduce_dtype or grad.dtype) for s in specs]
    return [grad.new_empty([rows, *s.rest], dtype=grad_dtype or grad.dtype)
            for s, rows in zip(specs, local_rows)]
