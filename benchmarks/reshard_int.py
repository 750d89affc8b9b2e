"""An int ``reshard_after_forward`` on the CPU: what it keeps, what it gathers,
what it costs, ours against FSDP2, paired step by step.

    python benchmarks/reshard_int.py [--world 4] [--size 2] [--layers 4] [--dim 256]
        [--warmup 2] [--steps 10] [--kinds KIND ...] [--out FILE]

The benchmark GPT (``examples/gpt.py``), each block sharded with
``reshard_after_forward`` set to True (over all ``world`` ranks), ``size``
(groups of ``size`` consecutive ranks after forward) or False, the root as
FSDP2's default; AdamW, 1 thread per rank. A kind is ``IMPL_RESHARD``:

  IMPL     ours_compiled (the whole model, Inductor), ours_eager, fsdp2_eager,
           fsdp2_blocks (each block compiled on its own: torchtitan's way)
  RESHARD  all, int, none

Reports per kind: the median step and its paired ratio to ``fsdp2_blocks_all``
(or the first kind), the first step (compile included), the peak of live
tensors in one step ([Note: Measuring memory on CPU] in workloads.py), and
the bytes each rank receives in the blocks' backward gathers, from the bucket
sizes: ``(G - 1) * T * W / G`` per block for a gather over ``G`` ranks of a
``T``-element shard (G = ``world`` for all, ``size`` for int, none for none).
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version  # (the release, read as the other benchmarks read it)
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.paired import add_paired_args, paired_run, paired_summary, report, timed_step  # noqa: E402
from benchmarks.workloads import tensor_peak_mb  # noqa: E402
from compiled_fsdp.tools.launch import run_distributed  # noqa: E402
from examples.gpt import batch, bench, loss_fn  # noqa: E402

IMPLS = ("ours_compiled", "ours_eager", "fsdp2_eager", "fsdp2_blocks")
KINDS = tuple(f"{i}_{r}" for i in IMPLS for r in ("all", "int", "none"))


def _step_fn(kind: str, size: int, layers: int, dim: int, rank: int) -> tuple[Callable[[], float], int]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from compiled_fsdp import fully_shard as ours_shard

    impl, reshard = kind.rsplit("_", 1)
    model = bench(n_layers=layers, dim=dim)
    shard = ours_shard if impl.startswith("ours") else fsdp2_shard
    for block in model.layers:
        shard(block, reshard_after_forward={"all": True, "int": size, "none": False}[reshard])
    shard(model)
    shard_numel = sum(p.to_local().numel() for p in model.layers[0].parameters())
    step = timed_step(model, impl, batch(model.cfg, 2, seed=rank), loss_fn)
    return step, shard_numel


def _rank(rank: int, world: int, size: int, kinds: list[str], layers: int, dim: int, warmup: int,
          steps: int) -> dict:
    torch.set_num_threads(1)
    numel = {}

    def make(kind: str) -> Callable[[], float]:
        step, numel["block"] = _step_fn(kind, size, layers, dim, rank)
        return step

    fns, out = paired_run(make, kinds, warmup, steps)
    return {**out, "peak_mb": {k: tensor_peak_mb(fns[k]) for k in kinds}, "block_shard_numel": numel["block"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_paired_args(ap, KINDS)
    ap.add_argument("--size", type=int, default=2)
    args = ap.parse_args()
    ranks = run_distributed(_rank, args.world, args.size, args.kinds, args.layers, args.dim, args.warmup,
                            args.steps, timeout=3600)
    base = "fsdp2_blocks_all" if "fsdp2_blocks_all" in args.kinds else args.kinds[0]
    shard = ranks[0]["block_shard_numel"]  # (fp32: 4 bytes)
    groups = {"all": args.world, "int": args.size, "none": 1}
    out = {"config": vars(args), "torch": version("torch"), **paired_summary(ranks, args.kinds, args.steps, base),
           "peak_tensor_mb": {k: max(r["peak_mb"][k] for r in ranks) for k in args.kinds},
           "backward_gather_mb_per_rank": {
               k: (g - 1) * shard * args.world / g * 4 * args.layers / 2**20
               for k in args.kinds for g in [groups[k.rsplit("_", 1)[1]]]}}
    report(out, args.out)


if __name__ == "__main__":
    main()
