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

__all__ = ["all_gather_bucket", "all_gather_part", "copy_out_all_gather", "reduce_bucket"]


def all_gather_bucket(
    shards: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    async_op: bool = True,
    streams: Optional[CommStreams] = None,
    device: Optional[torch.device] = None,
) -> PendingCollective:
    """One all-gather of the packed local ``shards``, each cast to its compute
    dtype (``dtypes``): output ``[N * T]``. Copy-in and collective on the
    gather stream ([Note: Streams and events]); with ``device``, the shards
    are first copied there, on that stream too ([Note: CPU offload] in policy.py)."""
    with streams.on_gather() if streams is not None else contextlib.nullcontext():
        if device is not None:
            shards = [s.to(device, non_blocking=True) for s in shards]
        flat_in = pack_shards(EAGER, [s.detach() for s in shards], specs, dtypes)
        if group.size() > 1:  # (a group of one communicates nothing)
            comm.count("all_gather", flat_in.numel() * flat_in.element_size())
        return comm.all_gather_flat(flat_in, group, async_op)


def all_gather_part(
    part: torch.Tensor, group: dist.ProcessGroup, streams: Optional[CommStreams] = None
) -> PendingCollective:
    """The all-gather over ``group`` of what each rank kept after forward
    (``layout.post_forward_part``): the bucket's ``[N * T]`` output again
    ([Note: Resharding to a smaller group] in groups.py)."""
    with streams.on_gather() if streams is not None else contextlib.nullcontext():
        comm.count("all_gather", part.numel() * part.element_size())
        return comm.all_gather_flat(part, group, async_op=True)


def copy_out_all_gather(
    flat_out: torch.Tensor, specs: Sequence[ShardSpec], dests: Sequence[torch.Tensor]
) -> None:
    """Copy each parameter's full value out of an all-gather output into ``dests``."""
    with torch.no_grad():
        for full, dest in zip(unpack_gathered(EAGER, flat_out, specs), dests):
            dest.copy_(full)


def reduce_bucket(
    grads: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    by_all_to_all: bool,
    replicate_group: Optional[dist.ProcessGroup] = None,
    streams: Optional[CommStreams] = None,
) -> PendingCollective:
    """One bucket's gradient reduction, issued, not awaited: output ``[T]``
    summed over the shard group and, with ``replicate_group`` (HSDP,
    ``replicate``), over the replicas too; not yet averaged. Packed on the
    compute stream, reduced on the reduce stream ([Note: Streams and events]).
    A shard group of one (``replicate``) reduces nothing within the group,
    so the replicas' all-reduce is issued at once; otherwise it follows the
    reduce-scatter when that is awaited ([Note: HSDP] in api.py)."""
    flat = pack_grads(EAGER, grads, specs)
    if group.size() > 1:
        comm.count("reduce_scatter", flat.numel() * flat.element_size())
    elif replicate_group is not None and len(grads) == 1:
        # (one gradient may be packed as itself: autograd may still hand that
        # tensor to another edge while the all-reduce below writes it in place)
        flat = comm.unaliased(flat, grads[0])
    with _on_reduce(streams):
        pending = comm.reduce_scatter_flat(flat, group, by_all_to_all, async_op=True)
        if replicate_group is None:
            return pending
        if group.size() == 1:
            return comm.all_reduce_flat(pending.output, replicate_group, async_op=True)

    def then_all_reduce(_: torch.Tensor) -> torch.Tensor:
        summed = pending.wait()
        with _on_reduce(streams):
            issued = comm.all_reduce_flat(summed, replicate_group, async_op=True)
        return issued.wait()  # (on the caller's stream, which then reads the sum)

    return PendingCollective(pending.output, None, finish=then_all_reduce)


def _on_reduce(streams: Optional[CommStreams]) -> contextlib.AbstractContextManager:
    return streams.on_reduce() if streams is not None else contextlib.nullcontext()
