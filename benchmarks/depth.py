"""Compile time against depth: the first step of each configuration at 8, 16
and 32 blocks, side by side.

    python benchmarks/depth.py [--depths 8 16 32] [--kinds KIND ...] [--steps 3] [--rounds 1] [--out DIR]

The benchmark GPT (``examples.gpt:bench``, d=512, batch 4x256 per rank) with
``--depths`` blocks on 2 gloo ranks, 1 thread each, every configuration in
fresh processes with Dynamo's, AOTAutograd's and Inductor's caches off (what
a user waits for after changing the model):

  compute_compiled      the unsharded model, ``torch.compile(model)``
  fsdp2_compiled        FSDP2 per block and root, ``torch.compile(model)``
  ours_compiled         ours per block and root, ``torch.compile(model)``: one
                        graph per direction holding every block
  ours_compiled_blocks  ours per block and root, ``block.compile()`` per block,
                        the root eager (see [Note: Blocks compiled on their own]),
                        each block's graph handing the next block its gather
  ours_compiled_blocks_nohandoff
                        the same with ``config.comm.hand_over_gathers = False``
                        (one block graph variant fewer to compile)

Reported per configuration and depth: ``first_step_s`` (compile and one
step), ``step_s`` (median of the next ``--steps``) and ``compile_s``, their
difference: the step itself grows with depth for everyone (32 blocks compute
four times as much as 8), so growth with depth is read from ``compile_s``. The
depths run interleaved (each depth: every configuration once), ``--rounds``
times; each cell is the median over rounds (all runs kept under ``runs``). Writes
``depth.json`` to ``--out``. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"), HERE]

from workloads import train_rank  # noqa: E402

from _dist import run_distributed  # noqa: E402

KINDS = ["compute_compiled", "fsdp2_compiled", "ours_compiled", "ours_compiled_blocks",
         "ours_compiled_blocks_nohandoff"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", nargs="*", type=int, default=[8, 16, 32])
    ap.add_argument("--kinds", nargs="*", default=KINDS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each cell this many times (rounds interleaved); report medians")
    ap.add_argument("--out", default="/tmp/compiled_fsdp_bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, dict[int, list[dict]]] = {k: {d: [] for d in args.depths} for k in args.kinds}
    for rnd in range(args.rounds):
        for depth in args.depths:
            for kind in args.kinds:
                t0 = time.perf_counter()
                per_rank = run_distributed(train_rank, 2, kind, 1, args.steps, depth, timeout=1800)
                first = max(r["first_step_s"] for r in per_rank)
                step = max(r["step_s"] for r in per_rank)
                runs[kind][depth].append({"first_step_s": first, "step_s": step, "compile_s": first - step})
                print(f"round {rnd} {depth:3d} blocks  {kind:30s} first step {first:6.1f} s  step {step:5.2f} s  "
                      f"compile {first - step:6.1f} s  (wall {time.perf_counter() - t0:.0f} s)", flush=True)
    rows = {k: {d: {what: statistics.median(r[what] for r in cell) for what in cell[0]} | {"runs": cell}
                for d, cell in by_depth.items()} for k, by_depth in runs.items()}
    ratios: dict[str, float] = {}
    lo, hi = min(args.depths), max(args.depths)
    for kind, by_depth in rows.items():
        for what in ("first_step_s", "compile_s"):
            if lo != hi:
                ratios[f"{kind} {what} {hi} / {lo} blocks"] = by_depth[hi][what] / by_depth[lo][what]
            if "fsdp2_compiled" in rows and kind != "fsdp2_compiled":
                for d in args.depths:
                    ratios[f"{kind} / fsdp2_compiled {what} at {d} blocks"] = (
                        by_depth[d][what] / rows["fsdp2_compiled"][d][what])
    for name, value in ratios.items():
        print(f"  {name:60s} {value:.3f}")
    with open(os.path.join(args.out, "depth.json"), "w") as f:
        json.dump({"steps": args.steps, "rows": rows, "ratios": ratios}, f, indent=1)
    print(f"wrote {args.out}/depth.json")


if __name__ == "__main__":
    main()
