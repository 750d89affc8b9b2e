"""Paired steps, shared by the benchmarks that compare configurations in one
process: the rotation ([Note: Paired steps] in run.py) and its summary."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["add_paired_args", "paired_run", "paired_summary", "report", "rotate_steps", "timed_step"]


def add_paired_args(ap: argparse.ArgumentParser, kinds: Sequence[str]) -> None:
    """The options of a paired benchmark of ``kinds`` on a small model."""
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kinds", nargs="+", default=list(kinds), choices=kinds)
    ap.add_argument("--out")


def rotate_steps(fns: dict[str, Callable[[], float]], steps: int) -> dict[str, list[float]]:
    """Each configuration's step times, one step of each in turn, the one that
    goes first rotating: the first of an iteration runs measurably slower."""
    kinds = list(fns)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(steps):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            times[kind].append(fns[kind]())
    return times


def paired_run(make: Callable[[str], Callable[[], float]], kinds: Sequence[str], warmup: int,
               steps: int) -> tuple[dict[str, Callable[[], float]], dict[str, Any]]:
    """On every rank: each kind's step made (``make``) and warmed up, its
    first step timed (compile included), then ``rotate_steps``. Returns the
    steps and this rank's ``times_s`` and ``first_step_s``."""
    fns, first = {}, {}
    for kind in kinds:
        fns[kind] = make(kind)
        dist.barrier()
        first[kind] = fns[kind]()
        for _ in range(warmup - 1):
            fns[kind]()
    dist.barrier()  # (the ranks finish compiling and warming up apart: start the steps together)
    return fns, {"times_s": rotate_steps(fns, steps), "first_step_s": first}


def paired_summary(ranks: list[dict], kinds: list[str], steps: int, base: str) -> dict[str, Any]:
    """The ranks' ``times_s`` and ``first_step_s`` as one run's: a step's time
    is its slowest rank's; the median of each kind and the median of its
    step-by-step ratios to ``base``."""
    times = {k: [max(r["times_s"][k][i] for r in ranks) for i in range(steps)] for k in kinds}
    return {"times_s": times,
            "first_step_s": {k: max(r["first_step_s"][k] for r in ranks) for k in kinds},
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "paired_ratio_to_" + base: {k: statistics.median(a / b for a, b in zip(times[k], times[base]))
                                        for k in kinds}}


def report(out: dict[str, Any], path: str | None) -> None:
    """Print ``out`` but its step times; write it all to ``path``, if given."""
    print(json.dumps({k: v for k, v in out.items() if k != "times_s"}, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def timed_step(model: Any, kind: str, tokens: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
               ) -> Callable[[], float]:
    """One AdamW step of ``model`` on ``tokens``, timed: each block compiled
    on its own for a kind ending ``_blocks``, the whole model for ``_compiled``."""
    run = model
    if kind.endswith("_blocks"):
        for block in model.layers:
            block.compile(fullgraph=True)
    elif kind.endswith("_compiled"):
        run = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        loss_fn(run(tokens), tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step

