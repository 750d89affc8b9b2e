"""Pure collective functions of the eager runtime: pack, communicate, unpack.

Every eager collective the project issues is counted, so tests can assert how
many ran (see ``collective_counts``). The packing and unpacking around each
collective is [Note: Bucket layout]'s, shared with the lowering.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from compiled_fsdp.core import compat
from compiled_fsdp.core.layout import EAGER, ShardSpec, pack_grads, pack_shards, sum_received, unpack_gathered
from compiled_fsdp.core.reduce import reduce_by_all_to_all

_COUNTS: collections.Counter = collections.Counter()
# Bytes each rank sent into the bucketed collectives, by kind.
_BYTES: collections.Counter = collections.Counter()


def collective_counts() -> dict[str, int]:
    """How many eager collectives the runtime issued, by kind, since the last reset."""
    return dict(_COUNTS)


def collective_bytes() -> dict[str, int]:
    """Bytes this rank contributed to the eager runtime's bucketed all-gathers and
    reduce-scatters, by kind, since the last reset."""
    return dict(_BYTES)


def reset_collective_counts() -> None:
    _COUNTS.clear()
    _BYTES.clear()


def count_collective(kind: str) -> None:
    """Counts a collective issued outside this module (the marker ops' eager
    implementations count as ``unbucketed_all_gather`` / ``unbucketed_reduce_scatter``)."""
    _COUNTS[kind] += 1


@dataclass
class PendingCollective:
    """An issued, not yet awaited collective and the buffer it writes."""

    output: torch.Tensor
    work: Optional[dist.Work]
    # Applied once, after the wait (the local sum of an all-to-all reduce).
    finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.output, self.finish = self.finish(self.output), None
        return self.output


def all_gather_bucket(
    shards: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    async_op: bool = True,
) -> PendingCollective:
    """One all-gather of the packed local ``shards``, each cast to its compute
    dtype (``dtypes``): output ``[N * T]``."""
    world = group.size()
    flat_in = pack_shards(EAGER, [s.detach() for s in shards], specs, dtypes)
    out = flat_in.new_empty(world * flat_in.numel())
    _COUNTS["all_gather"] += 1
    _BYTES["all_gather"] += flat_in.numel() * flat_in.element_size()
    work = compat.all_gather_single(out, flat_in, group=group, async_op=async_op)
    return PendingCollective(out, work if async_op else None)


def copy_out_all_gather(
    flat_out: torch.Tensor, specs: Sequence[ShardSpec], dests: Sequence[torch.Tensor]
) -> None:
    """Copy each parameter's full value out of an all-gather output into ``dests``."""
    with torch.no_grad():
        for full, dest in zip(unpack_gathered(EAGER, flat_out, specs), dests):
            dest.copy_(full)


def reduce_scatter_flat(
    flat_in: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> PendingCollective:
    """Sum-reduce-scatter of a contiguous ``[N * T]`` buffer: output ``[T]``. On
    gloo an all-to-all plus a local sum over ranks in rank order (see
    [Note: Reduce-scatter on gloo] in compiled_fsdp/_reduce.py), as the lowering does."""
    world = group.size()
    if reduce_by_all_to_all(group.group_name):
        recv = torch.empty_like(flat_in)
        work = dist.all_to_all_single(recv, flat_in, group=group, async_op=async_op)
        return PendingCollective(recv, work if async_op else None,
                                 finish=lambda t: sum_received(EAGER, t, world))
    out = flat_in.new_empty(flat_in.numel() // world)
    work = compat.reduce_scatter_single(out, flat_in, group=group, async_op=async_op)
    return PendingCollective(out, work if async_op else None)


def reduce_scatter_bucket(
    grads: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: dist.ProcessGroup,
    async_op: bool = True,
) -> PendingCollective:
    """One reduce-scatter (sum) of the full ``grads``: output ``[T]``, not yet averaged."""
    _COUNTS["reduce_scatter"] += 1
    flat = pack_grads(EAGER, grads, specs)
    _BYTES["reduce_scatter"] += flat.numel() * flat.element_size()
    return reduce_scatter_flat(flat, group, async_op)
