"""FSDP x TP (2-D) on the CPU: ours against FSDP2 on the same ``(dp, tp)``
mesh, paired step by step.

    python benchmarks/tp.py [--world 4] [--tp 2] [--layers 4] [--dim 256] [--warmup 2] [--steps 10]
        [--kinds KIND ...] [--out FILE]

The benchmark Llama (``benchmarks/llama.py``) with torch's TP plan on the
blocks' matmuls (column-wise q/k/v/w1/w3, row-wise wo/w2: one all-reduce
after each row-wise matmul, on ``tp``), then ``fully_shard`` on ``dp``, each
block and the root, AdamW, 1 thread per rank. Sequence parallelism and a
row-wise embedding are left out: with blocks compiled on their own torch
fails on them without FSDP ([Note: FSDP over DTensor parameters]), and every
kind runs the same plan. Kinds:

  ours_compiled        compiled_fsdp, the whole model compiled (Inductor)
  ours_blocks          compiled_fsdp, each block compiled on its own
  ours_eager           compiled_fsdp's eager runtime
  fsdp2_blocks         FSDP2, each block compiled on its own (torchtitan's way)
  fsdp2_eager          FSDP2
  tp_compiled          TP alone (no FSDP: every rank holds its TP shards whole), compiled:
                       the compute-and-TP floor

Reports each kind's median step and its ratio to ``fsdp2_blocks``, the
first step (compile included), and the medians of the paired ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version  # (the release, read as the other benchmarks read it)
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llama import LLAMA_TINY, Llama, batch, loss_fn  # noqa: E402
from benchmarks.paired import add_paired_args, paired_run, paired_summary, report, timed_step  # noqa: E402
from compiled_fsdp.tools.launch import run_distributed  # noqa: E402

KINDS = ("ours_compiled", "ours_blocks", "ours_eager", "fsdp2_blocks", "fsdp2_eager", "tp_compiled")


def _parallelize(model: Llama, tp_mesh: object) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })


def _step_fn(kind: str, mesh: object, cfg: object, dp_rank: int) -> Callable[[], float]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from compiled_fsdp import fully_shard as ours_shard

    torch.manual_seed(0)
    model = Llama(cfg)
    _parallelize(model, mesh["tp"])
    if kind != "tp_compiled":
        shard = ours_shard if kind.startswith("ours") else fsdp2_shard
        for block in model.layers:
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
    return timed_step(model, kind, batch(cfg, 2, seed=dp_rank), loss_fn)


def _rank(rank: int, world: int, tp: int, kinds: list[str], cfg: object, warmup: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    return paired_run(lambda kind: _step_fn(kind, mesh, cfg, dp_rank), kinds, warmup, steps)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_paired_args(ap, KINDS)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    cfg = LLAMA_TINY.with_(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, ffn=2 * args.dim,
                           vocab=1024, seq=128)
    ranks = run_distributed(_rank, args.world, args.tp, args.kinds, cfg, args.warmup, args.steps, timeout=3600)
    # A step's time is the slowest rank's.
    base = "fsdp2_blocks" if "fsdp2_blocks" in args.kinds else args.kinds[0]
    out = {"config": vars(args), "torch": version("torch"), **paired_summary(ranks, args.kinds, args.steps, base)}
    report(out, args.out)


if __name__ == "__main__":
    main()
