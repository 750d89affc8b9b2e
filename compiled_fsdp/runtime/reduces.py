"""A parameter group's issued gradient reductions, awaited oldest first, and
their rows handed to the parameters' ``.grad``.

[Note: Offloaded gradients land at the end of backward]
Under CPU offload each reduced gradient shard goes back to the host. Copied
blocking (``FSDPParam.add_grad``), each group's copy made the host wait for
the device to reach it, in the middle of backward: the device then idles
while the host queues the next block's kernels, once per group. On a device
with streams the eager runtime's copy is not blocking: into pinned memory
(where the policy pins), on the compute stream, which has waited for the
reduction as it does for every reduce's result, followed by an event
(``FSDPParam.grad_to_host``, ``GroupReduces.finish``). At the end of
backward, before anything else reads a gradient (the compiled path's later
reduces), the group synchronizes its events, and only then sets ``.grad``
and runs the post-accumulate-grad hooks (``land``); likewise at the end of
each backward under manual finalization, and at ``reset_iter_state`` (a
finished reduce was in ``.grad`` before). Copies left from a backward that
raised without ``reset_iter_state`` are dropped at the next root forward,
as a ``zero_grad`` in between would have dropped them from ``.grad``. A
compile region's later reduce hands its rows over the same way
(``copy_to_host``, from compile/region_reads.py; they land once the later
reduces are finished at the end of backward, ``LaterReduces.land_after`` in
core/registry.py): it copied each parameter's back blocking, a host sync a
parameter. FSDP2 sets ``.grad`` at once, runs the hooks on a copy still in
flight, and synchronizes before the optimizer in its final callback; here
``.grad`` and the hooks see the gradient only once it is there.

The copy stays on the compute stream, where it costs its transfer time in
stream order as the blocking copy did. On the reduce stream (FSDP2's choice)
it would overlap the next block's kernels, but there it could read memory
the compute stream reuses: the reduced buffer of a group of one rank is the
compute stream's, and NCCL gives the packed input back to the compute
stream's pool when the stream that waits its work does. That overlap is for
a GPU to measure first. On the CPU nothing is copied and nothing waits.
Tested by tests/test_streams.py::test_offloaded_gradients_land_after_their_event
and, for a region's, ::test_offloaded_rows_of_a_region_land_after_their_event.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from compiled_fsdp.core.comm import PendingCollective
from compiled_fsdp.core.layout import EAGER, split_reduced
from compiled_fsdp.runtime.divergence import PendingCheck
from compiled_fsdp.runtime.param import FSDPParam

if TYPE_CHECKING:
    from compiled_fsdp.runtime.streams import CommStreams

__all__ = ["GroupReduces", "PendingReduce", "byte_buckets", "copies_to_host"]


def copies_to_host(param: FSDPParam, streams: Optional["CommStreams"]) -> bool:
    """Whether ``param``'s reduced rows go to the host without blocking and
    land later: offloaded, on a device with streams."""
    return param.offload and streams is not None and streams.enabled


@dataclasses.dataclass
class PendingReduce:
    """One reduce bucket's issued collective, its check, and its parameters."""

    collective: PendingCollective
    check: Optional[PendingCheck]
    params: list[FSDPParam]


class GroupReduces:
    """One group's issued reductions, oldest first, and its offloaded
    gradients still on their way to the host."""

    def __init__(self) -> None:
        self.pending: list[PendingReduce] = []
        self._landing: list[tuple[FSDPParam, torch.Tensor]] = []
        # (an event after each finish's copies: each on the stream current then)
        self._copied: list[Any] = []

    def finish(self, streams: Optional["CommStreams"]) -> None:
        """Await the issued reductions (oldest first) and hand each parameter
        its averaged rows: into ``.grad`` at once, or, offloaded on a device
        with streams, copied to the host for ``land``."""
        while self.pending:
            reduce = self.pending.pop(0)  # (one at a time: abandon waits the rest)
            if reduce.check is not None:
                reduce.check.wait()
            summed = reduce.collective.wait()
            params = reduce.params
            grads = split_reduced(EAGER, summed, [p.spec for p in params], [p.local_rows for p in params],
                                  [p.orig_dtype for p in params])
            staged = []
            for p, g in zip(params, grads):
                if copies_to_host(p, streams):
                    staged.append((p, g))
                else:
                    p.add_grad(g)
            if staged:
                self.copy_to_host(staged, streams)

    def copy_to_host(self, rows: list[tuple[FSDPParam, torch.Tensor]], streams: "CommStreams") -> None:
        """Each parameter's reduced rows (canonical, on the device) copied to
        the host for ``land``, not blocking, one event after them."""
        self._landing.extend((p, p.grad_to_host(g)) for p, g in rows)
        self._copied.append(streams.compute_event())

    def land(self) -> None:
        """The offloaded gradients into ``.grad``, once their copies are done
        ([Note: Offloaded gradients land at the end of backward])."""
        copied, self._copied = self._copied, []
        for event in copied:
            event.synchronize()
        landing, self._landing = self._landing, []
        for p, host in landing:
            p.land_grad(host, owned=True)

    def abandon(self) -> None:
        """After an exception (``reset_iter_state``): await every issued
        reduction (every rank issued it) and drop its result; the finished
        ones land, as they were in ``.grad`` before."""
        pending, self.pending = self.pending, []
        for reduce in pending:  # (HSDP: the replicas' all-reduce follows its reduce-scatter, on every rank)
            reduce.collective.wait()
        self.land()

    def drop_copies(self) -> None:
        """A root forward begins with copies not landed (a backward raised
        and no ``reset_iter_state`` followed): they are dropped (the pinned
        allocator keeps their memory until they finish)."""
        self._landing, self._copied = [], []


def byte_buckets(params: list[FSDPParam], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The parameters' indices cut into reduce buckets of at most
    ``bucket_bytes`` (a larger parameter is a bucket of its own), filled in
    reverse registration order, as DDP does: see [Note: replicate's buckets]
    in replicate.py."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.spec.shard_numel * p.spec.world_size * p.reduce_dtype.itemsize
        if not buckets or (size + nbytes > bucket_bytes and size > 0):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return tuple(tuple(sorted(b)) for b in buckets)
