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

from ._collectives import count_collective, reduce_scatter_flat
from ._divergence import COLLECTIVE, Checkpoint, stable_code
from ._layout import (
    EAGER, ShardSpec, cast, pack_grads, pack_shards, reduce_input, split_reduced, unpack_gathered,
)

__all__ = ["ENTRY_KEY", "UNSHARD_SCHEMA", "REDUCE_GRAD_SCHEMA", "unshard", "reduce_grad"]

# Kept gradients an eager ``reduce_grad`` has already added (by identity); see
# [Note: Accumulation without sync in graphs].
_ADDED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# The ``module_key`` of a module compiled as its own frame (group keys count up
# from 0): see [Note: Blocks compiled on their own] in _param_group.py.
ENTRY_KEY = -1

UNSHARD_SCHEMA = (
    "(Tensor shard, SymInt[] full_shape, str group_name, int world_size, "
    "int module_key, int param_index, int local_rows, bool reshard_after_forward, "
    "str? reduce_group_name=None, ScalarType? param_dtype=None, ScalarType? reduce_dtype=None, "
    "Tensor? kept=None, bool sync=True, bool outermost=False) -> Tensor"
)
REDUCE_GRAD_SCHEMA = (
    "(Tensor grad, SymInt[] full_shape, str group_name, int world_size, "
    "int module_key, int param_index, int local_rows, ScalarType? reduce_dtype=None, "
    "ScalarType? grad_dtype=None, Tensor? kept=None, bool sync=True) -> Tensor"
)


def _spec(full_shape: Sequence[int], world_size: int) -> ShardSpec:
    return ShardSpec(tuple(full_shape), world_size)


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _check(op: str, module_key: int, param_index: int) -> None:
    """Agree on an unlowered marker's collective before issuing it; see [Note:
    Agreeing on collectives] in _divergence.py."""
    from ._param_group import _GROUPS

    owner = _GROUPS.get(module_key)
    if owner is not None and owner.checker is not None:
        owner.checker.check(Checkpoint(
            COLLECTIVE, owner.checker.step, stable_code(op, owner.identity, param_index),
            f"the per-parameter {op} of {owner.label}'s parameter {param_index}"))


# ---------------------------------------------------------------------------
# unshard
# ---------------------------------------------------------------------------


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
) -> torch.Tensor:
    specs = [_spec(full_shape, world_size)]
    flat = pack_shards(EAGER, [shard], specs, [param_dtype])
    if world_size == 1:
        gathered = flat.clone()
    else:
        gathered = flat.new_empty(world_size * flat.numel())
        count_collective("unbucketed_all_gather")
        _check("all-gather", module_key, param_index)
        dist.all_gather_single(gathered, flat, group=_group(group_name))
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


def _unshard_backward(ctx, grad):  # type: ignore[no-untyped-def]
    g = torch.ops.compiled_fsdp.reduce_grad(grad, *ctx.args, kept=ctx.kept, sync=ctx.sync)
    # The shard's gradient, or (without sync) the sink's; none for the rest.
    receiver = "shard" if ctx.sync else "kept"
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
) -> torch.Tensor:
    if not sync:  # the full gradient for the sink; see [Note: Accumulation without sync in graphs]
        full = cast(EAGER, grad, reduce_dtype)
        return full.clone() if full is grad else full
    if kept is not None:  # added once, however many reads: see the note
        if kept in _ADDED:
            kept = None
        else:
            _ADDED[kept] = None
    specs = [_spec(full_shape, world_size)]
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
) -> torch.Tensor:
    if not sync:
        return grad.new_empty(list(full_shape), dtype=reduce_dtype or grad.dtype)
    return grad.new_empty([local_rows, *_spec(full_shape, world_size).rest], dtype=grad_dtype or grad.dtype)
