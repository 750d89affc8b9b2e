"""The collectives the lowering emits, one definition each: a bucket's
all-gather and its gradient reduce, built from the layout functions of
compiled_fsdp/core/layout.py ([Note: Bucket layout]). The bucket lowering
(lowering.py) and the handoff between blocks' graphs (handoff.py) both use
them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from compiled_fsdp.core.layout import ShardSpec, pack_shards, sum_received

from .graph import NodeBuilder

c10d = torch.ops._c10d_functional


def emit_gather(
    b: NodeBuilder, shards: Sequence[fx.Node], specs: Sequence[ShardSpec],
    dtypes: Sequence[torch.dtype | None], world_size: int, group_name: str,
) -> fx.Node:
    """The bucket's pack and its ``all_gather_into_tensor``, not waited."""
    packed = pack_shards(b, list(shards), list(specs), list(dtypes))
    return b(c10d.all_gather_into_tensor.default, packed, world_size, group_name)


def emit_reduce(b: NodeBuilder, flat: fx.Node, world_size: int, group_name: str, by_all_to_all: bool) -> fx.Node:
    """The summed ``[T]`` of a packed ``[N * T]`` gradient bucket, waited: a
    ``reduce_scatter_tensor``, or (``by_all_to_all``, as the markers say) an
    all-to-all and a local sum (see [Note: Reduce-scatter on gloo] in
    compiled_fsdp/core/comm.py)."""
    if by_all_to_all:
        total = b.value(flat).numel() // world_size
        splits = [total] * world_size
        a2a = b(c10d.all_to_all_single.default, flat, splits, splits, group_name)
        return sum_received(b, b(c10d.wait_tensor.default, a2a), world_size)
    rs = b(c10d.reduce_scatter_tensor.default, flat, "sum", world_size, group_name)
    return b(c10d.wait_tensor.default, rs)


def emit_all_reduce(b: NodeBuilder, summed: fx.Node, group_name: str) -> fx.Node:
    """HSDP: the reduced ``[T]`` summed over the replicas (``all_reduce`` on
    the replicate group), waited."""
    return b(c10d.wait_tensor.default, b(c10d.all_reduce.default, summed, "sum", group_name))
