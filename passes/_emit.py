"""The collectives the lowering emits, one definition each: a bucket's
all-gather and its gradient reduce, built from the layout functions of
compiled_fsdp/core/layout.py ([Note: Bucket layout]). The bucket lowering
(lowering.py) and the handoff between blocks' graphs (handoff.py) both use
them. A handoff's take its ``live`` flag: [Note: A stand-in for the last
block's next] in compiled_fsdp/core/gated.py.

[Note: Byte buckets]
A gather bucket whose parameters gather in different dtypes (a float8
weight's bytes beside its block's norm: [Note: Float8 weights cast before
their gather in graphs] in cast_gather.py) moves their bytes: each shard,
cast to its compute dtype, is viewed ``[rows, bytes per row]`` as ``uint8``
and packed as a parameter of that shape, so the rows pad and cut as any
shard's do, and each gathered piece is viewed back. One collective per
bucket, as the eager runtime's extension gather sends it (ext_gather.py).
Not for a gather issued ahead or one an int ``reshard_after_forward`` keeps
a part of: those modules fall back (lowering.py). Tested by
tests/test_passes_fx.py and tests/test_float8.py.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from compiled_fsdp.core import copy_out
from compiled_fsdp.core.layout import (
    ShardSpec,
    average,
    bucket_offsets,
    bucket_width,
    cast,
    joined_shapes,
    pack_grads,
    pack_shards,
    split_averaged,
    sum_received,
    to_device,
    unpack_gathered,
    with_kept,
)

from .cost_model import A2A, A2A_IF, AG_IF, AR, AR_IF, RS, RS_IF, WAIT, all_gather_op
from .graph import NodeBuilder

aten = torch.ops.aten


def _issue(b: NodeBuilder, op: object, gated: object, live: fx.Node | None, *args: object) -> fx.Node:
    """``op`` on ``args``, or its gated twin with ``live`` last."""
    return b(op, *args) if live is None else b(gated, *args, live)


def emit_gather(
    b: NodeBuilder, shards: Sequence[fx.Node], specs: Sequence[ShardSpec],
    dtypes: Sequence[torch.dtype | None], world_size: int, group_name: str, live: fx.Node | None = None,
    device: str | None = None,
) -> fx.Node:
    """The bucket's pack (its shards first copied to ``device``: CPU offload)
    and its ``all_gather_into_tensor``, not waited."""
    flat = emit_pack_shards(b, shards, specs, dtypes, device)
    return _issue(b, all_gather_op(group_name, b.value(flat).device), AG_IF, live, flat, world_size, group_name)


def _shapes(specs: Sequence[ShardSpec]) -> tuple[list[int], list[int]]:
    return joined_shapes(specs), [len(s.full_shape) for s in specs]


def _as_one_op(b: NodeBuilder, like: fx.Node, device: str | None = None) -> bool:
    """Whether a bucket's copies on ``device`` (None: ``like``'s device) are
    emitted as one op ([Note: One copy-out per bucket] in
    compiled_fsdp/core/copy_out.py): on the CPU, yes; on a GPU Inductor's
    fused copies are kept."""
    return (b.value(like).device if device is None else torch.device(device)).type == "cpu"


def emit_pack_shards(b: NodeBuilder, shards: Sequence[fx.Node], specs: Sequence[ShardSpec],
                     dtypes: Sequence[torch.dtype | None], device: str | None = None) -> fx.Node:
    """``pack_shards`` as one ``pack_bucket`` op ([Note: One copy-out per
    bucket] in compiled_fsdp/core/copy_out.py), a bucket of one parameter
    too (its pack is a copy as well: a pad, if only of zero rows, which
    Inductor lowers as a clone), or as aten ops where the dtypes differ or
    the bucket is not on the CPU (``device``: where CPU offload copies the
    shards, part of the chain the schedule issues early: [Note: CPU offload
    in graphs] in lowering.py)."""
    if len(set(dtypes)) > 1 or not _as_one_op(b, shards[0], device):
        return pack_shards(b, list(shards), list(specs), list(dtypes), device)
    return b(copy_out.pack_bucket._opoverload, list(shards), *_shapes(specs), specs[0].world_size, dtypes[0])


def emit_pack_grads(b: NodeBuilder, grads: Sequence[fx.Node | None], specs: Sequence[ShardSpec],
                    offsets: Sequence[int] | None = None, total: int | None = None,
                    kept: Sequence[fx.Node | None] | None = None) -> fx.Node:
    """``pack_grads`` as one ``pack_bucket_grads`` op (see ``emit_pack_shards``),
    each gradient added to what ``kept`` holds for it (None: nothing kept);
    on the CPU inside the op, [Note: Kept gradients added where the bucket is
    packed]."""
    kept = [None] * len(grads) if kept is None else list(kept)
    like = next(g for g in grads if g is not None)
    # (one gradient and nothing kept: aten ops, a view of it where it needs no padding)
    alone = len(specs) == 1 and offsets is None and kept[0] is None
    if specs[0].world_size == 1 or alone or not _as_one_op(b, like):
        return pack_grads(b, [with_kept(b, g, k) for g, k in zip(grads, kept)], list(specs), offsets, total)
    offsets = bucket_offsets(specs) if offsets is None else list(offsets)
    total = bucket_width(specs) if total is None else total
    return b(copy_out.pack_bucket_grads._opoverload, list(grads), kept, *_shapes(specs), specs[0].world_size,
             list(offsets), total)


def emit_unpack(b: NodeBuilder, flat: fx.Node, specs: Sequence[ShardSpec],
                offsets: Sequence[int] | None = None, total: int | None = None) -> list[fx.Node]:
    """``unpack_gathered``: one ``unpack_bucket`` op where the parameters must
    be copied out ([Note: One copy-out per bucket] in
    compiled_fsdp/core/copy_out.py), views where the bucket is one parameter."""
    offsets = bucket_offsets(specs) if offsets is None else list(offsets)
    total = bucket_width(specs) if total is None else total
    if specs[0].world_size == 1 or all(s.shard_numel == total for s in specs) or not _as_one_op(b, flat):
        return unpack_gathered(b, flat, specs, offsets, total)
    out = b(copy_out.unpack_bucket._opoverload, flat, *_shapes(specs), specs[0].world_size, offsets, total)
    return [b(operator.getitem, out, i) for i in range(len(specs))]


# [Note: Static sizes in the reduce]
# A size the passes write into a graph must be an int, never read off a fake
# value: under torch.compile(dynamic=True) Dynamo makes a module's int
# attributes symbolic (a head count), a gradient's shape is then an
# expression in that symbol (``3*s0*(24//s0)`` rows for a 72-row weight),
# and torch's fake ``view`` to static sizes gives its output that
# expression back. The backward graph binds no such symbol, so the
# all-to-all's splits, taken from the packed bucket's fake ``numel()``,
# named one it did not bind: ``NameError: name 's197' is not defined`` at
# the first backward of ``replicate`` (where no padding interposes a
# static size). The splits now come from the bucket's specs, and the sum
# over ranks views the received bucket as ``[N, -1]`` (eager alike).
# Tested by tests/test_dynamic_shapes.py::test_replicate_under_dynamic_true.
def _reduce(b: NodeBuilder, flat: fx.Node, specs: Sequence[ShardSpec], group_name: str, by_all_to_all: bool,
            live: fx.Node | None = None) -> fx.Node:
    """The summed ``[T]`` of a packed ``[N * T]`` gradient bucket of ``specs``,
    waited: a ``reduce_scatter_tensor``, or (``by_all_to_all``, as the markers
    say) an all-to-all and a local sum (see [Note: Reduce-scatter on gloo] in
    compiled_fsdp/core/comm.py). Its sizes are the specs' ([Note: Static
    sizes in the reduce])."""
    world_size = specs[0].world_size
    if by_all_to_all:
        splits = [bucket_width(specs)] * world_size
        received = b(WAIT, _issue(b, A2A, A2A_IF, live, flat, splits, splits, group_name))
        if _as_one_op(b, received):  # ([Note: The reduce's arithmetic as ops on the CPU])
            return b(copy_out.sum_ranks._opoverload, received, world_size, splits[0])
        return sum_received(b, received, world_size)
    rs = _issue(b, RS, RS_IF, live, flat, "sum", world_size, group_name)
    return b(WAIT, rs)


def emit_reduced(b: NodeBuilder, flat: fx.Node, specs: Sequence[ShardSpec], local_rows: Sequence[int],
                 grad_dtypes: Sequence[torch.dtype | None], group_name: str, by_all_to_all: bool,
                 replicate_group_name: str | None = None, device: str | None = None,
                 live: fx.Node | None = None) -> list[fx.Node]:
    """Each parameter's averaged local rows of a packed ``[N * T]`` gradient
    bucket: ``_reduce``, HSDP's all-reduce over the replicas where
    ``replicate_group_name`` is given ([Note: HSDP] in
    compiled_fsdp/runtime/api.py), then ``average`` (one op on the CPU: [Note:
    The reduce's arithmetic as ops on the CPU] in compiled_fsdp/core/copy_out.py)
    and ``split_averaged``."""
    summed = _reduce(b, flat, specs, group_name, by_all_to_all, live=live)
    if replicate_group_name is not None:
        summed = _all_reduce(b, summed, replicate_group_name, live=live)
    if _as_one_op(b, summed):
        avg = b(copy_out.average_bucket._opoverload, summed, float(specs[0].divisor))
    else:
        avg = average(b, summed, specs[0].divisor)
    return split_averaged(b, avg, specs, local_rows, grad_dtypes, device)


def _all_reduce(b: NodeBuilder, summed: fx.Node, group_name: str, live: fx.Node | None = None) -> fx.Node:
    """HSDP: the reduced ``[T]`` summed over the replicas (``all_reduce`` on
    the replicate group), waited."""
    return b(WAIT, _issue(b, AR, AR_IF, live, summed, "sum", group_name))


def emit_gather_bytes(b: NodeBuilder, shards: Sequence[fx.Node], specs: Sequence[ShardSpec],
                      dtypes: Sequence[torch.dtype], world_size: int, group_name: str,
                      device: str | None = None) -> list[fx.Node]:
    """[Note: Byte buckets]: each shard copied to ``device`` (CPU offload:
    ``to_device``) and cast to its compute dtype (``dtypes``),
    viewed ``[rows, bytes per row]`` in ``uint8``, gathered in one bucket,
    waited, and each full value viewed back."""
    wire, byte_specs = [], []
    for shard, spec, dtype in zip(shards, specs, dtypes):
        rows = b.value(shard).shape[0]
        x = cast(b, to_device(b, shard, device), dtype)
        if shard.op != "placeholder":  # (a permuted view: Shard(d > 0); decided alike on every rank)
            x = b(aten.clone.default, x, memory_format=torch.contiguous_format)
        x = b(aten.view.default, x, [rows, math.prod(spec.rest)])
        wire.append(b(aten.view.dtype, x, torch.uint8))
        byte_specs.append(ShardSpec((spec.dim0, math.prod(spec.rest) * dtype.itemsize), world_size))
    waited = b(WAIT, emit_gather(b, wire, byte_specs, [None] * len(byte_specs), world_size, group_name))
    fulls = []
    for full, spec, dtype, offset in zip(emit_unpack(b, waited, byte_specs), specs, dtypes,
                                         bucket_offsets(byte_specs)):
        if offset % dtype.itemsize:  # (a view at an odd byte: one rank, nothing copied it out)
            full = b(aten.clone.default, full, memory_format=torch.contiguous_format)
        fulls.append(b(aten.view.default, b(aten.view.dtype, full, dtype), list(spec.full_shape)))
    return fulls
