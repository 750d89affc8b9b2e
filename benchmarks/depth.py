"""Compile time against depth: the first step of each configuration at 8, 32
and 80 blocks, side by side, and where each compile went.

    python benchmarks/depth.py [--depths 8 32 80] [--dim 512] [--kinds KIND ...]
        [--caches cold|warm|precompile] [--steps 3] [--rounds 1] [--out DIR]

The benchmark GPT (``examples.gpt:bench``, d=``--dim``, batch 4x256 per rank)
with ``--depths`` blocks on 2 gloo ranks, 1 thread each, every configuration
in fresh processes:

  compute_compiled      the unsharded model, ``torch.compile(model)``
  compute_compiled_regions
                        the same, each block a ``torch.compiler.nested_compile_region``
                        (torch's own compile regions: what a whole-model
                        compile costs before anything is sharded)
  fsdp2_compiled        FSDP2 per block and root, ``torch.compile(model)``
  fsdp2_compiled_blocks FSDP2 per block and root, ``block.compile()`` per block
                        (torchtitan's pattern)
  ours_compiled         ours per block and root, ``torch.compile(model)``: one
                        graph per direction holding every block
  ours_compiled_regions the same, each block a compile region
                        (``config.comm.block_regions``): traced and compiled once
  ours_compiled_blocks  ours per block and root, ``block.compile()`` per block,
                        the root eager (see [Note: Blocks compiled on their own]),
                        each block's graph handing the next block its gather
  ours_compiled_blocks_nohandoff
                        the same with ``config.comm.hand_over_gathers = False``

``--caches cold`` (default): Dynamo's, AOTAutograd's and Inductor's caches off
and an empty kernel cache directory (what a user waits for after changing the
model). ``--caches warm``: torch's caches on, each configuration run twice on
one fresh cache directory, the second run reported (a job started again
unchanged; its ``cache`` counts the hits). ``--caches precompile``: as warm,
with torch's caching precompile on (``torch._dynamo.config.caching_precompile``):
the first run also saves Dynamo's traces (``torch.compiler.save_cache_artifacts()``)
and the second loads them where it can instead of tracing (``phases_s``'
``dynamo_trace`` 0 on a rank that loaded).

Reported per configuration and depth: ``first_step_s`` (compile and one
step), ``step_s`` (median of the next ``--steps``), ``compile_s``, their
difference (the step itself grows with depth for everyone, so growth with
depth is read from ``compile_s``), and from rank 0 ``phases_s`` (Dynamo's
timers: bytecode tracing, AOTAutograd's joint trace, the partitioner,
Inductor, the whole compile), ``passes_s`` (our passes' own seconds, per
stage and pass), ``nodes`` (each graph's node count before and after our
passes), ``graphs`` (frames Dynamo compiled) and ``cache``. The depths run
interleaved (each depth: every configuration once), ``--rounds`` times; each
cell is the median over rounds (all runs kept under ``runs``). Writes
``depth.json`` to ``--out``. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"), HERE]

from workloads import compile_rank  # noqa: E402

from _dist import run_distributed  # noqa: E402

KINDS = ["compute_compiled", "compute_compiled_regions", "fsdp2_compiled", "fsdp2_compiled_blocks", "ours_compiled",
         "ours_compiled_regions", "ours_compiled_blocks", "ours_compiled_blocks_nohandoff"]


def measure(kind: str, depth: int, args: argparse.Namespace) -> dict:
    """One cell: the first step with cold caches, or the second run of a warm pair."""
    with tempfile.TemporaryDirectory(prefix="depth_cache_") as cache:
        warm, precompile = args.caches != "cold", args.caches == "precompile"
        for _ in range(2 if warm else 1):
            per_rank = run_distributed(compile_rank, 2, kind, args.steps, depth, args.dim, warm, cache, precompile,
                                       timeout=3600)
    first = max(r["first_step_s"] for r in per_rank)
    step = max(r["step_s"] for r in per_rank)
    return {"first_step_s": first, "step_s": step, "compile_s": first - step} | {
        k: per_rank[0][k] for k in ("phases_s", "passes_s", "nodes", "graphs", "cache")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", nargs="*", type=int, default=[8, 32, 80])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--caches", choices=("cold", "warm", "precompile"), default="cold")
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
                cell = measure(kind, depth, args)
                runs[kind][depth].append(cell)
                print(f"round {rnd} {depth:3d} blocks  {kind:30s} first step {cell['first_step_s']:6.1f} s  "
                      f"step {cell['step_s']:5.2f} s  compile {cell['compile_s']:6.1f} s  "
                      f"(wall {time.perf_counter() - t0:.0f} s)\n    phases {cell['phases_s']}\n"
                      f"    passes {cell['passes_s']}\n    nodes {cell['nodes']}  graphs {cell['graphs']}  "
                      f"cache {cell['cache']}", flush=True)
    timed = ("first_step_s", "step_s", "compile_s")
    rows = {k: {d: {what: statistics.median(r[what] for r in cell) for what in timed} | {"runs": cell}
                for d, cell in by_depth.items()} for k, by_depth in runs.items()}
    ratios: dict[str, float] = {}
    lo, hi = min(args.depths), max(args.depths)
    for kind, by_depth in rows.items():
        for what in ("first_step_s", "compile_s"):
            if lo != hi:
                ratios[f"{kind} {what} {hi} / {lo} blocks"] = by_depth[hi][what] / by_depth[lo][what]
            for peer in ("fsdp2_compiled", "fsdp2_compiled_blocks"):
                if peer in rows and kind != peer:
                    for d in args.depths:
                        ratios[f"{kind} / {peer} {what} at {d} blocks"] = by_depth[d][what] / rows[peer][d][what]
    for name, value in ratios.items():
        print(f"  {name:60s} {value:.3f}")
    with open(os.path.join(args.out, "depth.json"), "w") as f:
        json.dump({"steps": args.steps, "dim": args.dim, "caches": args.caches, "rows": rows, "ratios": ratios},
                  f, indent=1)
    print(f"wrote {args.out}/depth.json")


if __name__ == "__main__":
    main()
