"""How fast is the bucket copy-out after an all-gather? (single process, 1 thread)

    python benchmarks/copy_out.py [--world 2] [--iters 50]

One benchmark block's all-gather output ``[N * T]`` is split into its
parameters as the lowering does (see [Note: Bucket layout] in
compiled_fsdp/core/layout.py): a strided ``[N, n_i]`` column slice per parameter, made
contiguous. Timed three ways: eager ``clone``, the same function compiled by
Inductor (the code the compiled step runs), and ``torch.split_with_sizes_copy``
(the memcpy-speed kernel FSDP2 uses). Prints milliseconds per bucket. The
answer decided that the copy-out stays an Inductor-generated kernel (benchmarks/RESULTS.md,
"Results: the overlap benchmark").
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compiled_fsdp.core.layout import ShardSpec  # noqa: E402
from examples.gpt import bench  # noqa: E402


def _time(fn: Callable[[torch.Tensor], object], x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.world
    specs = [ShardSpec(tuple(p.shape), n) for p in bench().layers[0].parameters()]
    numels = [s.shard_numel for s in specs]
    total = sum(numels)

    def clone_out(g: torch.Tensor) -> list[torch.Tensor]:
        out2d, outs, off = g.view(n, total), [], 0
        for s, k in zip(specs, numels):
            piece = out2d[:, off:off + k].clone(memory_format=torch.contiguous_format)
            outs.append(s.unpad(piece.view(s.padded_dim0, *s.rest)))
            off += k
        return outs

    def split_copy(g: torch.Tensor) -> list[torch.Tensor]:
        pieces = torch.split_with_sizes_copy(g.view(n, total), numels, dim=1)
        return [s.unpad(p.view(s.padded_dim0, *s.rest)) for s, p in zip(specs, pieces)]

    x = torch.randn(n * total)
    print(f"bucket: {len(specs)} params, {n * total * 4 / 2**20:.1f} MiB gathered, {n} ranks")
    for name, fn in [("eager clone", clone_out), ("Inductor", torch.compile(clone_out)),
                     ("split_with_sizes_copy", split_copy)]:
        print(f"{name:22s} {_time(fn, x, args.iters):6.2f} ms")


if __name__ == "__main__":
    main()
