"""The eager runtime's bucket collectives: pack, communicate, unpack.

The packing and unpacking around each collective is [Note: Bucket layout]'s
(core/layout.py), shared with the lowering; the collectives themselves are
core/comm.py's, which also counts them (``collective_counts``)."""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from compiled_fsdp.core import comm
from compiled_fsdp.core.comm import PendingCollective
from compiled_fsdp.core.layout import EAGER, ShardSpec, pack_grads, pack_shards, unpack_gathered
from compiled_fsdp.runtime.streams import CommStreams

__all__ = ["all_gather_bucket", "all_reduce_bucket", "copy_out_all_gather", "reduce_scatter_bucket"]


def all_gather_bucket(
    shards: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    async_op: bool = True,
    streams: Optional[CommStreams] = None,
) -> PendingCollective:
    """One all-gather of the packed local ``shards``, each cast to its compute
    dtype (``dtypes``): output ``[N * T]``. Copy-in and collective on the
    gather stream ([Note: Streams and events])."""
    with streams.on_gather() if streams is not None else contextlib.nullcontext():
        flat_in = pack_shards(EAGER, [s.detach() for s in shards], specs, dtypes)
        if group.size() > 1:  # (a group of one communicates nothing)
            comm.count("all_gather", flat_in.numel() * flat_in.element_size())
        return comm.all_gather_flat(flat_in, group, async_op)


def copy_out_all_gather(
    flat_out: torch.Tensor, specs: Sequence[ShardSpec], dests: Sequence[torch.Tensor]
) -> None:
    """Copy each parameter's full value out of an all-gather output into ``dests``."""
    with torch.no_grad():
        for full, dest in zip(unpack_gathered(EAGER, flat_out, specs), dests):
            dest.copy_(full)


def reduce_scatter_bucket(
    grads: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    by_all_to_all: bool,
    async_op: bool = True,
    streams: Optional[CommStreams] = None,
) -> PendingCollective:
    """One reduce-scatter (sum) of the full ``grads``: output ``[T]``, not yet
    averaged. Packed on the compute stream, reduced on the reduce stream
    ([Note: Streams and events])."""
    flat = pack_grads(EAGER, grads, specs)
    if group.size() > 1:
        comm.count("reduce_scatter", flat.numel() * flat.element_size())
    with streams.on_reduce() if streams is not None else contextlib.nullcontext():
        return comm.reduce_scatter_flat(flat, group, by_all_to_all, async_op)


def all_reduce_bucket(
    summed: torch.Tensor, group: dist.ProcessGroup, streams: Optional[CommStreams] = None
) -> torch.Tensor:
    """HSDP: a reduced bucket ``[T]`` summed over the replicas (in place, on
    the reduce stream), waited."""
    with streams.on_reduce() if streams is not None else contextlib.nullcontext():
        return comm.all_reduce_flat(summed, group, async_op=False).wait()
