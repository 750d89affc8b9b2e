"""Two all-gathers in flight on one gloo group, as graphs and prefetches
issue them: torch's functional op against the package's
``compiled_fsdp::all_gather_by_work`` ([Note: All-gathers on gloo] in
compiled_fsdp/core/comm.py), and the two cases that tell where the fault
is: gloo's eager ``allgather_coalesced`` (the functional op's work type,
``ALLGATHER_COALESCED``, issued without it) and the functional op on a
group built with one worker thread. Reports, per op, whether a rank died
and how long it lasted. Run it on a new torch release to see whether the
race is still there; not part of CI (it crashes a rank on purpose).

    python benchmarks/gloo_inflight_gathers.py [--rounds 20000]
        [--ops functional by_work coalesced functional_one_thread]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from compiled_fsdp.tools.launch import run_distributed  # noqa: E402


def _one_thread_group() -> object:
    """A gloo group of this job's ranks with one worker thread (torch's
    ``init_process_group`` makes two), registered by name for the functional
    op; the registry holds it weakly, so the caller keeps it."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group

    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("one_thread", dist.distributed_c10d._get_default_store())
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._threads = 1
    group = dist.ProcessGroup(store, rank, world)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, rank, world, opts))
    group._set_group_name("one_thread")
    _register_process_group("one_thread", group)
    return group


def _rounds(rank: int, world: int, rounds: int, op: str) -> float:
    import torch
    import torch.distributed as dist

    from compiled_fsdp.core import comm

    group = _one_thread_group() if op == "functional_one_thread" else dist.group.WORLD
    name = group.group_name
    wait = torch.ops._c10d_functional.wait_tensor
    functional = torch.ops._c10d_functional.all_gather_into_tensor
    start = time.perf_counter()
    for i in range(rounds):
        xs = [torch.full((1000 + (i * 7919 + j * 104729) % 50000,), float(rank)) for j in range(2)]
        if op == "coalesced":  # (gloo's eager op of the same work type)
            lists = [[[torch.empty_like(x)] for _ in range(world)] for x in xs]
            works = [dist.group.WORLD.allgather_coalesced(lst, [x]) for lst, x in zip(lists, xs)]
            for work in works:
                work.wait()
            outs = [torch.cat([r[0] for r in lst]) for lst in lists]
        else:
            gather = comm.all_gather_by_work if op == "by_work" else functional
            outs = [wait(out) for out in [gather(x, world, name) for x in xs]]
        for x, out in zip(xs, outs):
            if not torch.equal(out, torch.arange(world).repeat_interleave(x.numel()).float()):
                raise RuntimeError(f"round {i}: a wrong all-gather")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--ops", nargs="*", default=["functional", "by_work", "coalesced", "functional_one_thread"])
    args = ap.parse_args()
    from compiled_fsdp.core.compat import torch_release

    release = "%d.%d" % torch_release()
    for op in args.ops:
        start = time.perf_counter()
        try:
            secs = max(run_distributed(_rounds, 2, args.rounds, op, timeout=900))
            print(f"torch {release} {op}: {args.rounds} rounds in {secs:.1f} s, no crash")
        except Exception as exc:  # (a rank killed by a signal, or a hang)
            print(f"torch {release} {op}: FAILED after {time.perf_counter() - start:.0f} s: "
                  f"{str(exc).splitlines()[0]}")


if __name__ == "__main__":
    main()
