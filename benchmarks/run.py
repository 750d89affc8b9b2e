"""The overlap benchmark: ours vs FSDP2 vs the physical limits, side by side.

    pip install -e ".[bench]" && python benchmarks/run.py [--rounds 2] [--steps 6] [--warmup 2]
        [--paired-steps 10] [--paired-kinds KIND ...] [--only KIND ...] [--out DIR]

Every configuration runs the GPT-like ~30M model (``examples.gpt:bench``, batch
4x256 per rank, AdamW) on 2 gloo ranks (``--world``), 1 thread each, in fresh processes:

  ours_compiled          compiled_fsdp + torch.compile (Inductor), scheduling on
  ours_compiled_nosched  the same, scheduling off (the partitioner's order;
                         on torch 2.14+ Inductor's simple_overlap then moves it)
  ours_compiled_composed scheduling on, not pinned against Inductor's
                         simple_overlap (torch 2.14+): it may move our
                         collectives up and waits down (config.overlap.own_order;
                         see [Note: Inductor's simple_overlap] in passes/pin.py)
  ours_compiled_onegroup scheduling on, reduce-scatters on the gather group
  ours_compiled_gloors   scheduling on, gradients reduced by gloo's own
                         reduce_scatter_tensor (see [Note: Reduce-scatter on gloo])
  ours_compiled_single   one fully_shard(model), no nesting: the passes choose
                         the units (see [Note: Units] in passes/units.py)
  ..._nounits            config.overlap.units off: one bucket per fully_shard
                         call (ours_compiled_single_nounits: the whole model)
  ours_compiled_blocks   nested, each block compiled on its own (block.compile(),
                         the root eager; see [Note: Blocks compiled on their own]),
                         each block's graph issuing the next block's gather
                         ([Note: Gathers handed to the next block's graph]);
                         benchmarks/depth.py measures compile time against depth
  ..._blocks_nohandoff   the same without the handoff (config.comm.hand_over_gathers):
                         each block's graph gathers and reduces its own
  ours_compiled_regions  torch.compile(model) with each block a compile region
                         (config.comm.block_regions; only when named, --only)
  ours_eager             compiled_fsdp's eager hook runtime
  ours_eager_single      the eager runtime on one fully_shard(model)
  ..._nocheck            ours_compiled, ours_eager without the checks that
                         the ranks' collectives agree (config.comm.check_collectives;
                         see [Note: Agreeing on collectives])
  fsdp2_eager            torch.distributed.fsdp.fully_shard
  fsdp2_compiled         FSDP2 + torch.compile
  ..._bf16               ours_compiled, fsdp2_eager, fsdp2_compiled and
                         compute_compiled with bf16 parameters for compute and
                         gathers, fp32 reduce (MixedPrecisionPolicy)
  ..._float8             the blocks' linears in torchao's float8 (emulated on the
                         CPU), gathered as float8, torchao's scale precompute
                         after each step (the float8 extra; only when named):
                         python benchmarks/run.py --rounds 0 --paired-kinds
                           ours_compiled_float8 ours_compiled_blocks_float8
                           fsdp2_compiled_blocks_float8 compute_compiled_float8
  ..._offload            CPUOffloadPolicy on both FSDPs (shards, gradients and
                         AdamW on the CPU; on a CPU-only machine no copies: what
                         is measured is the offload paths' own cost). Only when
                         named: python benchmarks/run.py --rounds 0 --paired-kinds
                           ours_compiled_regions_offload ours_compiled_blocks_offload
                           fsdp2_compiled_blocks_offload fsdp2_eager_offload compute_compiled
  ..._hsdp               ours_compiled, ours_eager, fsdp2_eager, fsdp2_compiled
                         on a (2, world/2) HSDP mesh: gathers and reduce-scatters
                         within each half, gradients all-reduced across them.
                         Only when named (--only, --paired-kinds), with --world 4:
                         python benchmarks/run.py --world 4 --layers 4 --rounds 0
                           --paired-kinds ours_compiled_hsdp ours_eager_hsdp
                           fsdp2_eager_hsdp fsdp2_compiled_hsdp compute_compiled
  compute_eager/compiled unsharded model, one process per rank at once, no communication
  comm_only              the step's collectives alone (same buckets and count)
  overlap_limit          compute_compiled with comm_only on a second thread at
                         the same time: the best any overlap can do here
                         (see [Note: The overlap limit] in benchmarks/workloads.py)

[Note: Benchmark rounds]
On this 2-core VM a configuration's step time drifts by 10-20% over minutes
(measured: the same ``ours_compiled`` run gave medians of 2.78-3.43 s in four
back-to-back runs, steps within a run agreeing to ~10%). So the configurations
run in ``--rounds`` interleaved rounds (each round every configuration once,
fresh processes), and a configuration's step time is the median over all its
measured steps of all rounds; the per-round medians are kept to show the spread.

[Note: Paired steps]
Rounds make the medians comparable on average, but a ratio of two medians
taken minutes apart still carries the drift (measured: ``overlap_limit /
max(compute, comm)`` was 1.03x in one run and 1.13x in two others). So the
headline ratios are also measured *paired*: ``PAIRED_KINDS`` are built in one
process pair (each compiled at once under its own knobs) and then run
alternately, one step of each per iteration, for ``--paired-steps``
iterations; each ratio is taken per iteration (max over ranks) and its
median, min and max are reported. The order rotates every iteration: the
configuration that ran first in every iteration was measured 6-9% slower
than its own runs in second place (benchmarks/RESULTS.md, "Results: units, one call against manual nesting"), so runs
before 2026-11-23's rotation put ``ours_compiled``, always first, at that
disadvantage. Memory is not measured there (the
configurations share the processes); it comes from the rounds. The same
method chose ``overlap.cover`` (benchmarks/RESULTS.md, "How far ahead to prefetch").

Writes ``results.json`` and ``results.png`` (if matplotlib is installed) to
``--out`` (default /tmp/compiled_fsdp_bench) and prints a table with ratios.
Not part of CI.
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

from workloads import comm_rank, overlap_limit_rank, paired_rank, train_rank  # noqa: E402

from _dist import run_distributed  # noqa: E402

# See [Note: Paired steps].
PAIRED_KINDS = ["ours_compiled", "fsdp2_eager", "compute_compiled", "comm_only", "overlap_limit",
                "ours_compiled_nosched", "ours_compiled_gloors", "ours_compiled_blocks"]
TRAIN_KINDS = ["ours_compiled", "ours_compiled_nosched", "ours_compiled_composed", "ours_compiled_onegroup",
               "ours_compiled_gloors", "ours_compiled_nocheck", "ours_compiled_single", "ours_compiled_single_nounits",
               "ours_compiled_nounits", "ours_compiled_blocks", "ours_compiled_blocks_nohandoff", "ours_eager",
               "ours_eager_single", "ours_eager_nocheck", "fsdp2_eager", "fsdp2_compiled", "compute_eager",
               "compute_compiled",
               "ours_compiled_bf16", "fsdp2_eager_bf16", "fsdp2_compiled_bf16", "compute_compiled_bf16"]
# HSDP on a (2, world/2) mesh, both FSDPs: only when named with --only (they need --world 4).
HSDP_KINDS = ["ours_compiled_hsdp", "ours_eager_hsdp", "fsdp2_eager_hsdp", "fsdp2_compiled_hsdp"]
# Only when named, as HSDP_KINDS: the blocks as compile regions (config.comm.block_regions).
NAMED_KINDS = [*HSDP_KINDS, "ours_compiled_regions"]


def _summary(rounds: list[list[dict]]) -> dict:
    """Per-rank results of each round -> step time (median over every measured
    step of every round, max over ranks), spread and memory; see [Note:
    Benchmark rounds]."""
    n_ranks = len(rounds[0])
    per_rank_steps = [[t for rnd in rounds for t in rnd[r]["times_s"]] for r in range(n_ranks)]
    out = {
        "step_s": max(statistics.median(ts) for ts in per_rank_steps),
        "round_medians_s": [max(r["step_s"] for r in rnd) for rnd in rounds],
        "per_round": rounds,
    }
    for key in ("rss_peak_mb", "step_peak_mb", "tensor_peak_mb", "first_step_s"):
        if key in rounds[0][0]:
            out[key] = max(r[key] for rnd in rounds for r in rnd)
    return out


def _plot(results: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results["configs"])
    paired = results.get("paired")
    fig, axes = plt.subplots(1, 3 if paired else 2, figsize=(19 if paired else 13, 4.5))
    a, b = axes[0], axes[1]
    a.barh(names, [results["configs"][n]["step_s"] for n in names], color="tab:blue")
    a.set_xlabel("rounds: median step time (s), max over ranks")
    if paired:  # See [Note: Paired steps]: the comparable numbers.
        kinds = paired["kinds"]
        axes[2].barh(kinds, [statistics.median(s[k] for s in paired["per_step_s"]) for k in kinds],
                     color="tab:green")
        axes[2].set_xlabel("paired: median step time (s), max over ranks")
    mem = [n for n in names if "step_peak_mb" in results["configs"][n]]
    b.barh(mem, [results["configs"][n]["step_peak_mb"] for n in mem], color="tab:orange")
    b.set_xlabel("peak RSS growth during a step (MiB), max over ranks")
    fig.suptitle("GPT ~30M, 2 gloo ranks x 1 thread, batch 4x256, AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


_RATIOS = [  # (name, numerator, denominator); "max(a, b)" means the larger of both
    ("ours_compiled / max(compute_compiled, comm_only)", "ours_compiled", ("compute_compiled", "comm_only")),
    ("overlap_limit / max(compute_compiled, comm_only)", "overlap_limit", ("compute_compiled", "comm_only")),
    ("ours_compiled / overlap_limit", "ours_compiled", "overlap_limit"),
    ("ours_compiled_blocks / ours_compiled", "ours_compiled_blocks", "ours_compiled"),
    ("ours_compiled_blocks / max(compute_compiled, comm_only)", "ours_compiled_blocks",
     ("compute_compiled", "comm_only")),
    ("ours_compiled_blocks / ours_compiled_blocks_nohandoff", "ours_compiled_blocks",
     "ours_compiled_blocks_nohandoff"),
    ("ours_compiled_blocks_nohandoff / ours_compiled", "ours_compiled_blocks_nohandoff", "ours_compiled"),
    ("ours_compiled_blocks / fsdp2_compiled", "ours_compiled_blocks", "fsdp2_compiled"),
    ("ours_compiled / fsdp2_eager", "ours_compiled", "fsdp2_eager"),
    ("ours_compiled / fsdp2_compiled", "ours_compiled", "fsdp2_compiled"),
    ("ours_compiled / ours_compiled_nosched", "ours_compiled", "ours_compiled_nosched"),
    ("ours_compiled / ours_compiled_composed", "ours_compiled", "ours_compiled_composed"),
    ("ours_compiled / ours_compiled_onegroup", "ours_compiled", "ours_compiled_onegroup"),
    ("ours_compiled / ours_compiled_gloors", "ours_compiled", "ours_compiled_gloors"),
    ("ours_eager / fsdp2_eager", "ours_eager", "fsdp2_eager"),
    ("ours_compiled_single / ours_compiled", "ours_compiled_single", "ours_compiled"),
    ("ours_compiled_single_nounits / ours_compiled", "ours_compiled_single_nounits", "ours_compiled"),
    ("ours_compiled / ours_compiled_nounits", "ours_compiled", "ours_compiled_nounits"),
    ("ours_eager_single / ours_eager", "ours_eager_single", "ours_eager"),
    ("ours_compiled / ours_compiled_nocheck", "ours_compiled", "ours_compiled_nocheck"),
    ("ours_compiled_hsdp / fsdp2_eager_hsdp", "ours_compiled_hsdp", "fsdp2_eager_hsdp"),
    ("ours_compiled_hsdp / fsdp2_compiled_hsdp", "ours_compiled_hsdp", "fsdp2_compiled_hsdp"),
    ("ours_compiled_hsdp / compute_compiled", "ours_compiled_hsdp", "compute_compiled"),
    ("fsdp2_compiled_hsdp / compute_compiled", "fsdp2_compiled_hsdp", "compute_compiled"),
    ("ours_eager_hsdp / fsdp2_eager_hsdp", "ours_eager_hsdp", "fsdp2_eager_hsdp"),
    ("ours_eager / ours_eager_nocheck", "ours_eager", "ours_eager_nocheck"),
    ("ours_compiled_bf16 / compute_compiled_bf16", "ours_compiled_bf16", "compute_compiled_bf16"),
    ("ours_compiled_bf16 / fsdp2_eager_bf16", "ours_compiled_bf16", "fsdp2_eager_bf16"),
    ("ours_compiled_bf16 / fsdp2_compiled_bf16", "ours_compiled_bf16", "fsdp2_compiled_bf16"),
    ("ours_compiled_bf16 / ours_compiled", "ours_compiled_bf16", "ours_compiled"),
    ("ours_compiled_blocks_float8 / fsdp2_compiled_blocks_float8", "ours_compiled_blocks_float8",
     "fsdp2_compiled_blocks_float8"),
    ("ours_compiled_float8 / fsdp2_compiled_blocks_float8", "ours_compiled_float8", "fsdp2_compiled_blocks_float8"),
    ("ours_compiled_float8 / compute_compiled_float8", "ours_compiled_float8", "compute_compiled_float8"),
    ("fsdp2_compiled_blocks_float8 / compute_compiled_float8", "fsdp2_compiled_blocks_float8",
     "compute_compiled_float8"),
]


def _ratios(c: dict[str, float]) -> dict[str, float]:
    """The headline ratios of step times ``c`` (those whose configs are present)."""
    out = {}
    for name, num, den in _RATIOS:
        dens = den if isinstance(den, tuple) else (den,)
        if num in c and all(d in c for d in dens):
            out[name] = c[num] / max(c[d] for d in dens)
    if {"compute_compiled", "comm_only"} <= c.keys():
        both = c["compute_compiled"] + c["comm_only"]
        for who in ("ours_compiled", "overlap_limit"):
            if who in c:  # see [Note: The overlap limit] in benchmarks/workloads.py
                out[f"fraction of comm_only hidden ({who})"] = (both - c[who]) / c["comm_only"]
    return out


def _paired(kinds: list[str], warmup: int, steps: int, world: int = 2, n_layers: int = 8) -> dict:
    """See [Note: Paired steps]."""
    per_rank = run_distributed(paired_rank, world, kinds, warmup, steps, n_layers, timeout=1800)
    per_step = [{k: max(r["times_s"][k][i] for r in per_rank) for k in kinds}
                for i in range(steps)]
    ratios = [_ratios(step) for step in per_step]
    out = {"kinds": kinds, "per_step_s": per_step, "ratios": {}}
    print(f"paired ({steps} steps, {', '.join(kinds)} alternating): "
          "median [min, max] of the per-step ratios", flush=True)
    for name in ratios[0]:
        vals = [r[name] for r in ratios]
        out["ratios"][name] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        print(f"  {name:52s} {statistics.median(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="/tmp/compiled_fsdp_bench")
    ap.add_argument("--only", nargs="*", default=None, help="subset of configurations")
    ap.add_argument("--paired-steps", type=int, default=10,
                    help="steps of the paired run (0: skip); see [Note: Paired steps]")
    ap.add_argument("--paired-kinds", nargs="*", default=PAIRED_KINDS,
                    help="configurations of the paired run (default: the headline ones)")
    ap.add_argument("--world", type=int, default=2, help="ranks (HSDP_KINDS need 4)")
    ap.add_argument("--layers", type=int, default=8, help="blocks of the benchmark GPT")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "configs": {}}
    kinds = [k for k in TRAIN_KINDS + ["comm_only", "overlap_limit"] + NAMED_KINDS
             if (k in args.only if args.only else k not in NAMED_KINDS)]
    raw: dict[str, list[list[dict]]] = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        for kind in kinds:
            t0 = time.perf_counter()
            if kind in ("comm_only", "overlap_limit"):
                fn = comm_rank if kind == "comm_only" else overlap_limit_rank
                per_rank = run_distributed(fn, args.world, args.warmup, args.steps, timeout=1200)
            else:
                per_rank = run_distributed(train_rank, args.world, kind, args.warmup, args.steps, args.layers,
                                           timeout=1200)
            raw[kind].append(per_rank)
            print(f"round {rnd} {kind:22s} median {max(r['step_s'] for r in per_rank):.3f} s "
                  f"(wall {time.perf_counter() - t0:.0f} s)", flush=True)
    for kind in kinds if args.rounds else []:
        res = results["configs"][kind] = _summary(raw[kind])
        spread = ", ".join(f"{m:.3f}" for m in res["round_medians_s"])
        print(f"{kind:22s} step {res['step_s']:.3f} s (rounds {spread})  "
              f"step-peak {res.get('step_peak_mb', float('nan')):7.1f} MiB  "
              f"tensor-peak {res.get('tensor_peak_mb', float('nan')):7.1f} MiB  "
              f"rss {res.get('rss_peak_mb', float('nan')):7.1f} MiB", flush=True)
    ratios = _ratios({k: v["step_s"] for k, v in results["configs"].items()})
    cfg = results["configs"]
    for num, den in (("ours_compiled", "fsdp2_eager"), ("ours_compiled", "ours_compiled_composed"),
                     ("ours_compiled", "ours_compiled_nosched"), ("ours_compiled_single", "ours_compiled"),
                     ("ours_compiled_single_nounits", "ours_compiled"),
                     ("ours_compiled", "ours_compiled_nounits"), ("ours_eager_single", "ours_eager"),
                     ("ours_compiled_regions", "ours_compiled")):
        if {num, den} <= cfg.keys():
            ratios[f"step_peak {num} / {den}"] = cfg[num]["step_peak_mb"] / cfg[den]["step_peak_mb"]
            ratios[f"tensor_peak {num} / {den}"] = cfg[num]["tensor_peak_mb"] / cfg[den]["tensor_peak_mb"]
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k:52s} {v:.3f}")
    if args.paired_steps:
        results["paired"] = _paired(args.paired_kinds, args.warmup, args.paired_steps, args.world, args.layers)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plotted = bool(results["configs"]) and _plot(results, os.path.join(args.out, "results.png"))
    print(f"wrote {args.out}/results.json" + (" and results.png" if plotted else ""))


if __name__ == "__main__":
    main()
