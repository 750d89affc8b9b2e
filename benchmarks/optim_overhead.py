"""What do DTensor parameters cost in the optimizer step? (2 gloo ranks, 1 thread)

    python benchmarks/optim_overhead.py [--iters 20]

The benchmark GPT (``examples.gpt:bench``) is sharded as in the main benchmark
(every block, then the root), so its parameters are the ``Shard(0)`` DTensors a
user's optimizer sees. ``torch.optim.AdamW`` steps them and, alternately in the
same process, a second AdamW steps plain tensors of the same local shapes: the
difference is DTensor's dispatch overhead per step. Both for the default
(foreach) implementation and ``fused=True``. Prints the median milliseconds of
each (max over ranks) and the median of the per-step ratios. Not part of CI.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

from _dist import run_distributed  # noqa: E402


def _rank(rank: int, world: int, iters: int) -> dict:
    import torch

    from compiled_fsdp import fully_shard
    from examples.gpt import bench

    torch.set_num_threads(1)
    model = bench()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    dparams = list(model.parameters())
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in dparams]
    for d, p in zip(dparams, plain):
        g = torch.randn_like(p)
        p.grad = g
        d.grad = torch.distributed.tensor.DTensor.from_local(
            g.clone(), d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())
    opts = {f"{kind} {impl}": torch.optim.AdamW(ps, lr=1e-4, fused=impl == "fused" or None)
            for impl in ("foreach", "fused") for kind, ps in (("DTensor", dparams), ("plain", plain))}
    times: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(iters + 2):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:  # the first steps create the state
                times[name].append(time.perf_counter() - t0)
    return {k: v for k, v in times.items()} | {"n_params": len(dparams)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ranks = run_distributed(_rank, 2, args.iters, timeout=900)
    keys = [k for k in ranks[0] if k != "n_params"]
    per_iter = {k: [max(r[k][i] for r in ranks) for i in range(args.iters)] for k in keys}
    med = {k: statistics.median(v) * 1e3 for k, v in per_iter.items()}
    print(f"AdamW.step over {ranks[0]['n_params']} parameters, median of {args.iters} (max over 2 ranks):")
    for impl in ("foreach", "fused"):
        d, p = per_iter[f"DTensor {impl}"], per_iter[f"plain {impl}"]
        ratio = statistics.median(a / b for a, b in zip(d, p))
        print(f"  {impl:8s} DTensor {med[f'DTensor {impl}']:7.2f} ms, plain {med[f'plain {impl}']:7.2f} ms, "
              f"paired ratio {ratio:.3f}x")


if __name__ == "__main__":
    main()
