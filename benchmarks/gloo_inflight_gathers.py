"""Two all-gathers in flight on one gloo group, as graphs and prefetches
issue them: torch's functional op against the package's
``compiled_fsdp::all_gather_by_work`` ([Note: All-gathers on gloo] in
compiled_fsdp/core/comm.py). Reports, per op, whether a rank died and how
long it lasted. Run it on a new torch release to see whether the functional
op is still unsafe there; not part of CI (it crashes a rank on purpose).

    python benchmarks/gloo_inflight_gathers.py [--rounds 20000] [--ops functional by_work]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from compiled_fsdp.tools.launch import run_distributed  # noqa: E402


def _rounds(rank: int, world: int, rounds: int, op: str) -> float:
    import torch
    import torch.distributed as dist

    from compiled_fsdp.core import comm

    name = dist.group.WORLD.group_name
    gather = torch.ops._c10d_functional.all_gather_into_tensor if op == "functional" else comm.all_gather_by_work
    start = time.perf_counter()
    for i in range(rounds):
        xs = [torch.full((1000 + (i * 7919 + j * 104729) % 50000,), float(rank)) for j in range(2)]
        outs = [gather(x, world, name) for x in xs]
        for x, out in zip(xs, outs):
            out = torch.ops._c10d_functional.wait_tensor(out)
            if not torch.equal(out, torch.arange(world).repeat_interleave(x.numel()).float()):
                raise RuntimeError(f"round {i}: a wrong all-gather")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--ops", nargs="*", default=["functional", "by_work"])
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
