"""The pure collective functions both paths use: a flat all-gather, a flat
reduce-scatter (or its gloo form), and the counts of what the eager code
issued.

[Note: Reduce-scatter on gloo]
Gloo has no reduce-scatter of its own: torch 2.13's
``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones the whole input
on the calling thread, all-reduces the clone (moving every byte twice: a
reduce-scatter and an all-gather inside the ring) and copies this rank's
chunk out on ``wait``. An all-to-all moves only the bytes a reduce-scatter
needs: each rank sends chunk ``j`` of its input to rank ``j`` and receives
every rank's copy of its own chunk, then sums the ``[N, T]`` rows locally.
Measured on this project's CPU machines (benchmarks/RESULTS.md, "Reducing
gradients on gloo"): the all-to-all is faster and uses less CPU from 4 MB buckets up.
So on gloo both runtimes reduce by all-to-all; NCCL keeps its
reduce-scatter. The sum runs over rows in rank order, ``((g_0 + g_1) + ...)``;
the eager runtime and the lowering both use it, so they stay bitwise equal.
For 2 ranks it is also bitwise equal to gloo's all-reduce (one addition).

The decision depends only on the group's backend, which is the same on every
rank, and on ``compiled_fsdp.config.comm.gloo_reduce_by_all_to_all`` (agreed
at ``fully_shard``): the runtime makes it once per group (``uses_all_to_all``)
and passes it to the collectives below and, in the markers, to the lowering.

[Note: All-gathers on gloo]
Torch's functional all-gather (``_c10d_functional.all_gather_into_tensor``,
which graphs and the eager prefetches issue without waiting) runs on gloo
as a work of type ``ALLGATHER_COALESCED``, and gloo's two worker threads
race on that name: each, after its work completes and with the group's
lock released, assigns the finished work's type name to one ``std::string``
of the group's status (``runLoop`` in torch's ProcessGroupGloo.cpp; found
by reading torch's source and its 2.15 binary). A name of more than 15
characters lives on the heap, so two works finishing together free one
buffer twice: SIGSEGV, or glibc's "malloc(): unaligned tcache chunk
detected", on a thread with no Python frame. The eager all-gather
(``ALLGATHER``), reduce-scatter, all-to-all and all-reduce have short
names and never touch the heap. Measured (2 gloo ranks, rounds of two
gathers of a few thousand elements in flight, then waited, every value
checked; ``python benchmarks/gloo_inflight_gathers.py``), torch 2.15:
- the functional op: a rank died within 8 s (2.13, 2.11: within 30 s);
- the eager ``allgather_coalesced``, same name, not functional: died in
  6-18 s (2.11: 9 s);
- the functional op on a group built with one worker thread: 30,000
  rounds, no crash (2.11: 20,000);
- the eager ``all_gather_into_tensor``: 30,000 rounds, no crash.
One functional gather at a time races too, when the thread that finished
the last one is descheduled for a whole collective: 200,000 rounds with a
busy loop on one of the two cores did not crash, and CI met it once, in
DTensor's ``full_tensor`` called for every parameter in turn (the tests
gather with the eager op: ``whole`` in tests/_parity.py).
So on gloo every all-gather this package leaves unwaited is
``compiled_fsdp::all_gather_by_work``: the eager collective, with its work
registered for its output (``_register_work``, as torch does for a
collective a graph takes in flight), so that the functional
``wait_tensor`` waits it as it waits the functional op's. A graph on gloo
carries that op where it carried torch's (the lowering asks
``gathers_by_work``; passes/cost_model.py counts it among the gathers), and
so do the all-gathers Dynamo traced into it on a gloo group (tensor
parallelism's: ``gloo_gathers_by_work`` in passes/collectives.py, before
the partitioned graph's passes). NCCL and the one-process groups keep
torch's op. DTensor's own gathers (``full_tensor``, tensor parallelism's
eager redistributes) are torch's and stay as they are. Tested by
tests/test_gloo_reduce.py::test_gathers_in_flight_on_gloo and, for the
traced ones, tests/test_tensor_parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from compiled_fsdp.core import compat, registry
from compiled_fsdp.core.layout import EAGER, sum_received

__all__ = [
    "EMULATED_BACKEND", "ONE_PROCESS_BACKENDS", "PendingCollective", "all_gather_by_work", "all_gather_flat",
    "all_gather_unwaited", "all_reduce_flat", "backend_on", "collective_bytes", "collective_counts", "count",
    "gathers_by_work", "reduce_scatter_flat", "reset_collective_counts", "unaliased", "uses_all_to_all",
]

# The backend name of the emulated network (compiled_fsdp/tools/emulated.py):
# one process plays one rank of a larger job, as torch's "fake" group does.
EMULATED_BACKEND = "emulated"
# Backends under which one process stands in for every rank.
ONE_PROCESS_BACKENDS = ("fake", EMULATED_BACKEND)


def collective_counts() -> dict[str, int]:
    """How many eager collectives were issued, by kind, since the last reset:
    ``all_gather`` / ``reduce_scatter`` (the runtime's buckets) and
    ``unbucketed_all_gather`` / ``unbucketed_reduce_scatter`` (markers no
    pass lowered, run by their eager implementations)."""
    return dict(registry.CORE.counts)


def collective_bytes() -> dict[str, int]:
    """Bytes this rank contributed to the eager runtime's bucketed all-gathers and
    reduce-scatters, by kind, since the last reset."""
    return dict(registry.CORE.sent_bytes)


def reset_collective_counts() -> None:
    registry.CORE.reset_counts()


def count(kind: str, nbytes: int = 0) -> None:
    """Counts one eager collective of ``kind`` (and the bytes this rank sent)."""
    registry.CORE.counts[kind] += 1
    if nbytes:
        registry.CORE.sent_bytes[kind] += nbytes


def unaliased(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """``out``, copied if it shares ``inp``'s storage (a custom op must not
    return an alias of its input, and an in-place collective must not write
    a tensor autograd still hands elsewhere)."""
    same = out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    return out.clone() if same else out


def backend_on(group: dist.ProcessGroup, device: Union[torch.device, str]) -> Optional[object]:
    """``group``'s backend for ``device``'s type, or None where it has none
    (torch's thread ranks, the emulated network, a device no backend
    registered). Asked first whether it has one: the error ``_get_backend``
    raises costs 0.1 ms, and a region's gathers ask at every issue."""
    device = torch.device(device)
    if device.type not in (d.type for d in group._device_types):
        return None
    try:
        return group._get_backend(device)
    except RuntimeError:
        return None


def gathers_by_work(group_name: str, device: Union[torch.device, str]) -> bool:
    """Whether an all-gather left unwaited on the group named ``group_name``
    is ``all_gather_by_work`` ([Note: All-gathers on gloo]): that group's
    backend for ``device`` is gloo. False for a name no process group has
    (a hand-built graph's)."""
    if not (dist.is_initialized() and dist.is_gloo_available()):
        return False
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    except RuntimeError:  # (no such group: a hand-built graph's)
        return False
    return isinstance(backend_on(group, device), dist.ProcessGroupGloo)


@torch.library.custom_op("compiled_fsdp::all_gather_by_work", mutates_args=(), tags=compat.cudagraph_unsafe_tags())
def all_gather_by_work(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor``'s result, not waited, issued as the eager
    collective: ``wait_tensor`` waits it ([Note: All-gathers on gloo])."""
    out = inp.new_empty([group_size * inp.shape[0], *inp.shape[1:]])
    group = dist.distributed_c10d._resolve_process_group(group_name)
    work = compat.all_gather_single(out, inp.contiguous(), group=group, async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


@all_gather_by_work.register_fake
def _(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return inp.new_empty([group_size * inp.shape[0], *inp.shape[1:]])


def all_gather_unwaited(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """The all-gather of ``inp`` over ``group_name``, not waited: torch's
    functional op, or on gloo ``all_gather_by_work`` ([Note: All-gathers on gloo])."""
    if gathers_by_work(group_name, inp.device):
        return all_gather_by_work(inp, group_size, group_name)
    return torch.ops._c10d_functional.all_gather_into_tensor(inp, group_size, group_name)


def uses_all_to_all(group: dist.ProcessGroup, enabled: bool) -> bool:
    """Whether a bucket's reduce on ``group`` is an all-to-all plus a local sum
    (gloo, with ``config.comm.gloo_reduce_by_all_to_all``): see [Note:
    Reduce-scatter on gloo]."""
    return enabled and dist.get_backend(group) == "gloo"


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


def all_gather_flat(flat_in: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True) -> PendingCollective:
    """Every rank's ``[T]`` into one ``[N * T]``, in rank order. A group of
    one rank communicates nothing (as FSDP2): the input is the output."""
    if group.size() == 1:
        return PendingCollective(flat_in, None)
    out = flat_in.new_empty(group.size() * flat_in.numel())
    work = compat.all_gather_single(out, flat_in, group=group, async_op=async_op)
    return PendingCollective(out, work if async_op else None)


def reduce_scatter_flat(
    flat_in: torch.Tensor, group: dist.ProcessGroup, by_all_to_all: bool, async_op: bool = True
) -> PendingCollective:
    """Sum-reduce-scatter of a contiguous ``[N * T]`` buffer: output ``[T]``;
    with ``by_all_to_all`` an all-to-all plus a local sum over ranks in rank
    order (see [Note: Reduce-scatter on gloo]), as the lowering does."""
    world = group.size()
    if world == 1:  # nothing to reduce with (as FSDP2, no collective)
        return PendingCollective(flat_in, None)
    if by_all_to_all:
        recv = torch.empty_like(flat_in)
        work = dist.all_to_all_single(recv, flat_in, group=group, async_op=async_op)
        return PendingCollective(recv, work if async_op else None,
                                 finish=lambda t: sum_received(EAGER, t, world))
    out = flat_in.new_empty(flat_in.numel() // world)
    work = compat.reduce_scatter_single(out, flat_in, group=group, async_op=async_op)
    return PendingCollective(out, work if async_op else None)


def all_reduce_flat(flat: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True,
                    counted: bool = True) -> PendingCollective:
    """HSDP: the sum of ``flat`` over ``group`` (the replicas of a shard
    group), in place. A group of one rank communicates nothing. ``counted``:
    an eager collective (a compile region's later reduce is its graph's)."""
    if group.size() == 1:
        return PendingCollective(flat, None)
    if counted:
        count("all_reduce", flat.numel() * flat.element_size())
    work = dist.all_reduce(flat, group=group, async_op=async_op)
    return PendingCollective(flat, work if async_op else None)
