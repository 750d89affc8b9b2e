"""How a bucket's reduce-scatter is carried out on a given process group.

[Note: Reduce-scatter on gloo]
Gloo has no reduce-scatter of its own: torch 2.13's
``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones the whole input
on the calling thread, all-reduces the clone (moving every byte twice: a
reduce-scatter and an all-gather inside the ring) and copies this rank's
chunk out on ``wait``. An all-to-all moves only the bytes a reduce-scatter
needs: each rank sends chunk ``j`` of its input to rank ``j`` and receives
every rank's copy of its own chunk, then sums the ``[N, T]`` rows locally.
Measured (2 gloo ranks, 1 thread each, this 2-core machine, median of 15):

    bucket     reduce_scatter_tensor     all_to_all_single + sum(0)
    4.2 MB     12.6 ms, 5.3 ms CPU       4.5 ms, 3.2 ms CPU
    12.6 MB    26.1 ms, 14.2 ms CPU      16.3 ms, 9.4 ms CPU
    17.0 MB    42.7 ms, 21.1 ms CPU      28.5 ms, 12.0 ms CPU

(CPU is the process's, gloo's threads included: here communication competes
with compute for the same cores, so CPU saved is step time saved.) On 3 ranks
the wall time is a wash at 4-13 MB and 2.3x better at 17 MB, CPU 1.1-1.8x
lower. So on gloo both runtimes reduce by all-to-all; NCCL keeps its
reduce-scatter. The sum runs over rows in rank order, ``((g_0 + g_1) + ...)``;
the eager runtime and the lowering both use it, so they stay bitwise equal.
For 2 ranks it is also bitwise equal to gloo's all-reduce (one addition).

The decision depends only on the group's backend, which is the same on every
rank, and on ``compiled_fsdp.config.comm.gloo_reduce_by_all_to_all``.
"""

from __future__ import annotations

from compiled_fsdp.config import comm


def reduce_by_all_to_all(group_name: str) -> bool:
    """True when the bucket reduce on ``group_name`` is an all-to-all plus a
    local sum (gloo; see [Note: Reduce-scatter on gloo]). A name that is not a
    live process group (hand-built test graphs) keeps ``reduce_scatter_tensor``."""
    if not comm.gloo_reduce_by_all_to_all:
        return False
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        return False
    try:
        group = _resolve_process_group(group_name)
    except RuntimeError:  # "Could not resolve the process group ..."
        return False
    return dist.get_backend(group) == "gloo"
