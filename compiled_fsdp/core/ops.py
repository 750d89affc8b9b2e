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
and the lowering share ([Note: Bucket layout] in layout.py). ``param_dtype``
and ``reduce_dtype`` are the parameter's mixed-precision dtypes ([Note: Mixed
precision] in runtime/policy.py).

[Note: Accumulation without sync in graphs]
``sync`` and ``kept`` carry FSDP2's ``set_requires_gradient_sync`` into the
graph. The parameter property reads the flag while Dynamo traces, so Dynamo
guards on it (and on whether a gradient is kept): in an accumulation loop one
graph per flag value, no recompile when it flips back; a synced step with
nothing kept (one micro-batch per step, evaluation) is a third graph. The flag
takes effect at the forward, so it must not change before that forward's
backward (FSDP2 reads it in backward): the root checks this when the backward
starts and raises (``RootContext.watch_compiled_backward``). A parameter that
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
sees it (``registry.CORE.added``). Tested by tests/test_no_sync.py.

[Note: Kept gradients added where the bucket is packed]
A synced backward after micro-batches without sync adds each parameter's kept
gradient to its new one before the reduce. As an add in the graph, Inductor
fuses it into the kernel that produced the gradient (a bias's sum over rows,
a norm weight's gradient), so that graph's backward kernels matched neither
the no-sync graph's nor a one-micro-batch step's, and each was compiled
again: the main job at 2 micro-batches built 31 C++ kernels against 24 at 1
(benchmarks/RESULTS.md, forty-eighth session). Where a bucket is packed by an
op, the op adds it instead (``with_kept`` in layout.py, the eager runtime's
arithmetic): a region's ``reduce_later`` on every device, and
``pack_bucket_grads`` on the CPU ([Note: One copy-out per bucket] in
copy_out.py). The graph then only casts each gradient, as the other graphs
do, and Inductor's cache serves their kernels to it: 24 kernels at either
count. The one-graph lowering on a GPU keeps the add in the graph, fused, as
its copies are. Tested by tests/test_passes_fx.py::test_kept_gradients_without_sync
(the CPU graph op for op the one that keeps nothing) and
tests/test_no_sync.py::test_compiled_accumulation_without_sync_regions.

[Note: Local rows in the marker]
``local_rows`` is also the input's first dimension, and it is passed anyway:
the Dynamo graph is otherwise the same on every rank (its inputs are DTensors
of the same global shape), and AOTAutograd's cache keys a DTensor input by its
global spec only. Ranks sharing a cache directory (every rank of a host does)
would then load each other's compiled graphs, built for a different local
shape. With the row count in the graph, ranks holding different rows get
different keys, and ranks holding the same rows still share one compile.
Tested by tests/test_compile_parity.py::test_a_second_job_hits_the_caches[whole].
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

# (copy_out, gated: the other ops the passes emit, defined with these: a
# trace saved by torch's caching precompile calls them once it loads, before
# any pass runs: [Note: Generated classes by reference] in runtime/generated.py)
from compiled_fsdp.core import comm, compat, copy_out, gated, registry  # noqa: F401
from compiled_fsdp.core.layout import (
    EAGER,
    ShardSpec,
    bucket_width,
    cast,
    pack_grads,
    pack_shards,
    reduce_input,
    split_reduced,
    split_specs,
    unpack_gathered,
    with_kept,
)
from compiled_fsdp.core.marker import GatherNext, IssueAhead, ReduceGrad, ReduceLater, ReduceNext, Regather, Unshard

__all__ = ["gather_next", "issue_ahead", "reduce_grad", "reduce_later", "reduce_next", "regather", "unshard"]



def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _before_collective(op: str, module_key: int, param_index: int) -> None:
    """An unlowered marker is about to communicate: its owner agrees on it
    with the other ranks first (see [Note: Agreeing on collectives] in
    runtime/divergence.py)."""
    owner = registry.owner_of(module_key)
    if owner is not None:
        owner.before_marker_collective(op, param_index)


def _over_replicas(summed: torch.Tensor, m: Any, param_index: int) -> torch.Tensor:
    """HSDP and ``replicate``: ``summed`` summed over the replicas too (a
    ``reduce_grad``'s or ``reduce_next``'s ``m``). On a shard group of one the
    all-reduce is the only collective, agreed on first, and runs on a copy
    where ``summed`` is still the op's input (an op must not write it)."""
    if m.replicate_group_name is None:
        return summed
    if m.world_size == 1:
        _before_collective("all-reduce", m.module_key, param_index)
        summed = comm.unaliased(summed, m.grad)
    return comm.all_reduce_flat(summed, _group(m.replicate_group_name), async_op=False).wait()


def _reduced(flat: torch.Tensor, world_size: int, group_name: str, by_all_to_all: bool) -> torch.Tensor:
    """The summed ``[T]`` of a packed ``[N * T]`` gradient, reduced now."""
    if world_size == 1:
        return flat.clone()
    return comm.reduce_scatter_flat(flat, _group(group_name), by_all_to_all, async_op=False).wait()


# ---------------------------------------------------------------------------
# unshard
# ---------------------------------------------------------------------------


@torch.library.custom_op(Unshard.qualname(), mutates_args=(), schema=Unshard.schema())
def unshard(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = Unshard.bind(args, kwargs)
    specs = [ShardSpec(tuple(m.full_shape), m.world_size)]
    if m.gathered is not None:  # handed over: see [Note: Gathers handed to the next block's graph]
        flat = torch.ops._c10d_functional.wait_tensor(m.gathered)
        return comm.unaliased(unpack_gathered(EAGER, flat, specs, [m.bucket_offset], m.bucket_numel)[0], m.gathered)
    flat = pack_shards(EAGER, [m.shard], specs, [m.param_dtype], m.device)
    if m.world_size == 1:
        gathered = flat.clone()
    else:
        comm.count("unbucketed_all_gather")
        _before_collective("all-gather", m.module_key, m.param_index)
        gathered = comm.all_gather_flat(flat, _group(m.group_name), async_op=False).wait()
    # custom ops must not return an alias of an input; `gathered` is fresh.
    return unpack_gathered(EAGER, gathered, specs)[0]


@unshard.register_fake
def _unshard_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = Unshard.bind(args, kwargs)
    return m.shard.new_empty(list(m.full_shape), dtype=m.param_dtype or m.shard.dtype, device=m.device)


def _unshard_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    read = Unshard.bind(inputs, {})
    ctx.grad_dtype, ctx.handed = read.shard.dtype, read.gathered is not None
    ctx.shard_device = str(read.shard.device)  # (where CPU offload's reduced rows go back to)
    # Without the shard and the handed-in bucket: only what the backward reads
    # (the kept gradient with sync) stays alive until then.
    ctx.read = dataclasses.replace(read, shard=None, gathered=None, kept=read.kept if read.sync else None)


def _unshard_backward(ctx, grad):  # type: ignore[no-untyped-def]
    read = ctx.read
    g = ReduceGrad.call(**ReduceGrad.of_read(read, grad, ctx.grad_dtype, ctx.handed, ctx.shard_device).values())
    # The shard's gradient, or (without sync) the sink's, or the handed-over
    # gather's; none for the rest.
    receiver = "gathered" if ctx.handed else "shard" if read.sync else "kept"
    return tuple(g if name == receiver else None for name in Unshard.names())


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# ---------------------------------------------------------------------------
# reduce_grad
# ---------------------------------------------------------------------------


@torch.library.custom_op(ReduceGrad.qualname(), mutates_args=(), schema=ReduceGrad.schema())
def reduce_grad(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = ReduceGrad.bind(args, kwargs)
    specs = [m.spec]
    if m.bucket_numel:  # the gradient of a handed-over gather: this parameter's columns
        return comm.unaliased(pack_grads(EAGER, [m.grad], specs, [m.bucket_offset], m.bucket_numel), m.grad)
    if not m.sync:  # the full gradient for the sink; see [Note: Accumulation without sync in graphs]
        full = cast(EAGER, m.grad, m.reduce_dtype)
        return full.clone() if full is m.grad else full
    kept = m.kept
    if kept is not None:  # added once, however many reads: see the note
        if kept in registry.CORE.added:
            kept = None
        else:
            registry.CORE.added[kept] = None
    flat = pack_grads(EAGER, [reduce_input(EAGER, m.grad, kept, m.reduce_dtype)], specs)
    if m.world_size > 1:
        comm.count("unbucketed_reduce_scatter")
        _before_collective("reduce-scatter", m.module_key, m.param_index)
    summed = _over_replicas(_reduced(flat, m.world_size, m.group_name, m.reduce_by_all_to_all), m, m.param_index)
    # Sum then divide, cut to the local rows: the bucketed path's steps.
    return split_reduced(EAGER, summed, specs, [m.local_rows], [m.grad_dtype], m.device)[0]


@reduce_grad.register_fake
def _reduce_grad_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = ReduceGrad.bind(args, kwargs)
    grad = m.grad
    if m.bucket_numel:
        return grad.new_empty([m.world_size * m.bucket_numel])
    if not m.sync:
        return grad.new_empty(list(m.full_shape), dtype=m.reduce_dtype or grad.dtype)
    rest = ShardSpec(tuple(m.full_shape), m.world_size).rest
    return grad.new_empty([m.local_rows, *rest], dtype=m.grad_dtype or grad.dtype, device=m.device)


# ---------------------------------------------------------------------------
# gather_next / reduce_next: see [Note: Gathers handed to the next block's graph]
# ---------------------------------------------------------------------------


def _next_specs(m: GatherNext) -> list[ShardSpec]:
    return split_specs(m.full_shapes, [s.dim() for s in m.shards], m.world_size, m.divide_factor, m.replicas)


@torch.library.custom_op(GatherNext.qualname(), mutates_args=(), schema=GatherNext.schema())
def gather_next(*args: Any, **kwargs: Any) -> torch.Tensor:
    """One module's bucketed all-gather, returned *not waited*: whoever reads
    it waits (``unshard(gathered=...)``)."""
    m = GatherNext.bind(args, kwargs)
    if not bool(m.live):  # a stand-in: [Note: A stand-in for the last block's next] in gated.py
        return _gather_next_fake(*args, **kwargs)
    return issue_gather(list(m.shards), _next_specs(m), m.param_dtype, m.group_name, m.module_key)


# [Note: Gathers issued by ops on the gather stream]
# The ops that issue a bucket's gather in their eager code and leave it in
# flight (``gather_next``, the compile regions' ``issue_ahead``, the
# backward's re-gathers issued ahead, ``regather``'s own) pack it where the
# eager runtime's ``unshard`` does: on the root's gather stream, after that
# stream waited for the compute stream ([Note: Streams and events] in
# runtime/streams.py), reached through the group's ``issuing_gather``. On
# the compute stream, the pack (the shards' copy from the host under CPU
# offload, their cast to the compute dtype) held up every kernel queued
# after it: under offload a block's host copy (a 27M-parameter fp32 shard of
# Llama-3.1-8B at W=8 is 109 MB, some 2-4 ms at the host link) before each
# block's forward and backward. The reader waits the collective's work on
# its own stream (``wait_tensor``). A gather on one rank communicates
# nothing, so no work would order its reader behind the pack: it stays on
# the current stream. On the CPU there are no streams. Tested by
# tests/test_streams.py::test_region_gathers_issued_on_the_gather_stream.


def _issuing_gather(module_key: int, world_size: int) -> contextlib.AbstractContextManager:
    owner = registry.owner_of(module_key) if world_size > 1 else None
    return owner.issuing_gather() if owner is not None else contextlib.nullcontext()


def issue_gather(shards: list[torch.Tensor], specs: list[ShardSpec], param_dtype: Optional[torch.dtype],
                 group_name: str, module_key: int, counted: bool = True, device: Optional[str] = None
                 ) -> torch.Tensor:
    """One bucket's pack (its shards first copied to ``device``: CPU
    offload) and all-gather, not waited (a fresh tensor), on the gather
    stream ([Note: Gathers issued by ops on the gather stream]); ``counted``
    in ``collective_counts`` (a graph's ``regather`` is not: it stands for
    the graph's own gather)."""
    world_size = specs[0].world_size
    with _issuing_gather(module_key, world_size):
        flat = pack_shards(EAGER, shards, specs, [param_dtype] * len(specs), device)
        if world_size == 1:
            return flat.clone()
        if counted:
            comm.count("all_gather")
        _before_collective("all-gather", module_key, -1)
        return comm.all_gather_unwaited(flat, world_size, group_name)  # ([Note: All-gathers on gloo] in comm.py)


@gather_next.register_fake
def _gather_next_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = GatherNext.bind(args, kwargs)
    total = bucket_width(_next_specs(m))
    return m.shards[0].new_empty([m.world_size * total], dtype=m.param_dtype or m.shards[0].dtype)


def _gather_next_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.gather = GatherNext.bind(inputs, {})
    # Autograd wants a gradient of each input's structure: a list for a list
    # of tensors (an empty one too), None for anything else (a list with a
    # None in it is one opaque argument).
    ctx.lists = {name: len(v) for name, v in ctx.gather.values().items()
                 if isinstance(v, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in v)}


def _gather_next_backward(ctx, grad):  # type: ignore[no-untyped-def]
    # With sync: the kept gradients are added and the sum reduced, the shards
    # get their part. Without: the sinks get the full gradients.
    gather = ctx.gather
    grads = ReduceNext.call(**ReduceNext.of_gather(gather, grad).values())
    given = ({"shards": list(grads)} if gather.sync
             else {"sinks": [grads[i] for i in gather.sink_params]})
    return tuple(given.get(name, [None] * ctx.lists[name] if name in ctx.lists else None)
                 for name in GatherNext.names())


gather_next.register_autograd(_gather_next_backward, setup_context=_gather_next_setup_context)


@torch.library.custom_op(ReduceNext.qualname(), mutates_args=(), schema=ReduceNext.schema())
def reduce_next(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The backward of ``gather_next``: ``grad`` is the full gradient of the
    whole bucket, in the gather's layout."""
    m = ReduceNext.bind(args, kwargs)
    specs = split_specs(m.full_shapes, m.ndims, m.world_size, m.divide_factor, m.replicas)
    if not m.sync:  # the full gradients, for the sinks
        full = cast(EAGER, m.grad, m.reduce_dtype)
        return [f.clone() for f in unpack_gathered(EAGER, full, specs)]
    if m.live is not None and not bool(m.live):  # a stand-in's: nothing to reduce
        return [g.zero_() for g in _reduce_next_fake(*args, **kwargs)]
    kept = list(m.kept)
    kept_flat = pack_grads(EAGER, kept, specs) if any(k is not None for k in kept) else None
    flat = reduce_input(EAGER, m.grad, kept_flat, m.reduce_dtype)
    if m.world_size > 1:
        comm.count("reduce_scatter")
        _before_collective("reduce-scatter", m.module_key, -1)
    summed = _over_replicas(_reduced(flat, m.world_size, m.group_name, m.reduce_by_all_to_all), m, -1)
    dtypes = [m.grad_dtype] * len(specs)
    return [g.clone() for g in split_reduced(EAGER, summed, specs, list(m.local_rows), dtypes)]


@reduce_next.register_fake
def _reduce_next_fake(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
    m = ReduceNext.bind(args, kwargs)
    specs = split_specs(m.full_shapes, m.ndims, m.world_size, m.divide_factor)
    if not m.sync:
        return [m.grad.new_empty(list(s.full_shape), dtype=m.reduce_dtype or m.grad.dtype) for s in specs]
    return [m.grad.new_empty([rows, *s.rest], dtype=m.grad_dtype or m.grad.dtype)
            for s, rows in zip(specs, m.local_rows)]


# ---------------------------------------------------------------------------
# regather: see [Note: Backward re-gathers prefetched across graphs] in registry.py
# ---------------------------------------------------------------------------


def shards_key(shards: list[torch.Tensor]) -> registry.BucketKey:
    """Which bucket a list of shards is: where each one's data lives, its
    storage and offset (a graph reads its module's shards by value, whatever
    module it was compiled for). Not the address: every empty shard has 0,
    and two buckets of empty shards on one rank only would be one there."""
    return tuple((s.untyped_storage()._cdata, s.storage_offset()) for s in shards)


def issue_if_wanted(shards: list[torch.Tensor], specs: list[ShardSpec], param_dtype: Optional[torch.dtype],
                    group_name: str, module_key: int, *, backward: bool, kept: bool = False,
                    device: Optional[str] = None) -> bool:
    """Issue the gather of ``shards`` for a ``regather`` to take, not waited,
    if one of its kind (``backward`` or not) took this bucket before and none
    is pending, or of each part of it such ops took ([Note: A bucket issued
    in the parts its graph takes] in registry.py); returns whether any was
    issued ([Note: Backward re-gathers prefetched across graphs] in registry.py)."""
    key = shards_key(shards)
    gathers = registry.CORE.backward_gathers
    parts = gathers.wanted(key, backward)
    if len(set(key)) < len(key):  # (two shards on one place, empty ones: no part is told apart by place)
        parts = [part for part in parts if part == key]
    at = {shard: i for i, shard in enumerate(key)}
    for part in parts:
        mine = range(len(key)) if part == key else [at[shard] for shard in part]
        gathered = issue_gather([shards[i] for i in mine], [specs[i] for i in mine], param_dtype, group_name,
                                module_key, False, device)
        gathers.issue(part, gathered, kept, whole=key)
    return bool(parts)


def _regather_specs(m: Regather) -> list[ShardSpec]:
    return split_specs(m.full_shapes, [s.dim() for s in m.shards], m.world_size)


@torch.library.custom_op(Regather.qualname(), mutates_args=(), schema=Regather.schema(),
                         tags=compat.cudagraph_unsafe_tags())
def regather(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The gathered bucket of ``shards``, waited: prefetched, or gathered now;
    a ``backward`` one then issues the gather chained after it."""
    m = Regather.bind(args, kwargs)
    shards = list(m.shards)
    gathers = registry.CORE.backward_gathers
    key = shards_key(shards)
    gathered = gathers.take(key, m.backward)
    if gathered is None:
        gathered = issue_gather(shards, _regather_specs(m), m.param_dtype, m.group_name, m.module_key,
                                counted=False, device=m.device)
    if m.backward:
        gathers.issue_next(key)
    return torch.ops._c10d_functional.wait_tensor(gathered)


@regather.register_fake
def _regather_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = Regather.bind(args, kwargs)
    total = bucket_width(_regather_specs(m))
    return m.shards[0].new_empty([m.world_size * total], dtype=m.param_dtype or m.shards[0].dtype,
                                 device=m.device)


@torch.library.custom_op(IssueAhead.qualname(), mutates_args=(), schema=IssueAhead.schema(),
                         tags=compat.cudagraph_unsafe_tags())
def issue_ahead(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Issue the gather of ``shards`` for a later ``regather`` to take (if a
    ``regather`` took this bucket before). Returns an empty tensor: what the
    pin orders ([Note: Inductor reorders for peak memory] in passes/pin.py)."""
    m = IssueAhead.bind(args, kwargs)
    issue_if_wanted(list(m.shards), _regather_specs(m), m.param_dtype, m.group_name, m.module_key, backward=False,
                    device=m.device)
    return m.shards[0].new_empty([0])


@issue_ahead.register_fake
def _issue_ahead_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    return IssueAhead.bind(args, kwargs).shards[0].new_empty([0])


# Its effect is the registry's: its output unused, never dead code.
torch.fx.node.has_side_effect(issue_ahead._opoverload)


# ---------------------------------------------------------------------------
# reduce_later: see [Note: A region's reduce-scatter waited outside its graph] in registry.py
# ---------------------------------------------------------------------------


@torch.library.custom_op(ReduceLater.qualname(), mutates_args=(), schema=ReduceLater.schema(),
                         tags=compat.cudagraph_unsafe_tags())
def reduce_later(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Pack the gradients and issue their reduce-scatter, not waited; the
    registry waits it and hands each parameter its rows. Packed here, not in
    the graph: the collective reads the bucket after the op returns, and a
    graph's buffer may be reused once its last op ran."""
    m = ReduceLater.bind(args, kwargs)
    specs = split_specs(m.full_shapes, m.ndims, m.world_size, m.divide_factor, m.replicas)
    grads, targets = list(m.grads), list(m.targets)
    local_rows, dtypes = list(m.local_rows), [t.dtype for t in targets]

    def rows(summed: comm.PendingCollective) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(targets, split_reduced(EAGER, summed.wait(), specs, local_rows, dtypes)))

    def launch() -> registry.LaterReduce:
        # (one unpadded gradient packs as a view of it: a buffer of the graph, which
        # may reuse it once this op ran, while the collective still reads it)
        # (the kept gradients added here: [Note: Kept gradients added where the bucket is packed])
        summed = [with_kept(EAGER, g, k) for g, k in zip(grads, m.kept)]
        flat = comm.unaliased(pack_grads(EAGER, summed, specs), grads[0])
        pending = comm.PendingCollective(flat, None) if m.world_size == 1 \
            else comm.reduce_scatter_flat(flat, _group(m.group_name), m.reduce_by_all_to_all)

        def reduced(_bucket: torch.Tensor = flat) -> Any:
            # (``_bucket``: the collective reads it until the wait, so it lives as long as this does)
            if m.replicate_group_name is None:
                return rows(pending)
            summed = comm.all_reduce_flat(pending.wait(), _group(m.replicate_group_name), counted=False)  # (HSDP)
            return lambda: rows(summed)
        return reduced

    registry.CORE.later_reduces.issue(launch)
    return grads[0].new_empty([0])


@reduce_later.register_fake
def _reduce_later_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    return ReduceLater.bind(args, kwargs).grads[0].new_empty([0])


# Its effect is the registry's: its output unused, never dead code.
torch.fx.node.has_side_effect(reduce_later._opoverload)
