"""Measures the constants of ``compiled_fsdp.passes.cost_model`` on this machine.

    python benchmarks/calibrate.py          # CPU compute, 2 gloo ranks
    python benchmarks/calibrate.py --gpu    # one GPU's compute (links: published figures)

Compute: 1-thread matmul throughput (FLOP/s) and elementwise bandwidth (bytes/s).
Communication: 2 gloo ranks (1 thread each), functional all_gather_into_tensor,
the gradient reduce as the project runs it on gloo (all-to-all plus a local
sum, see [Note: Reduce-scatter on gloo]) and, for comparison, gloo's own
reduce_scatter_tensor, over sizes 16 KiB .. 16 MiB; a least-squares fit of
``t = alpha + bytes / beta`` where ``bytes`` is the unsharded buffer (the gather's
output, the reduce-scatter's input). Prints the constants to paste into the
cost model; nothing is read at compile time (every rank must agree on them).
"""
from __future__ import annotations

import os
import sys

import torch

from compiled_fsdp.tools.cpu_compute import median_s

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

SIZES = [1 << k for k in range(14, 25)]  # bytes of the unsharded buffer


def compute_constants() -> dict:
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 512), torch.randn(512, 2048)
    flops = 2 * 1024 * 512 * 2048 / median_s(lambda: a @ b, 10)
    x, y = torch.randn(1 << 22), torch.randn(1 << 22)
    bw = 3 * 4 * (1 << 22) / median_s(lambda: x + y, 10)
    return {"matmul_flops_per_s": flops, "elementwise_bytes_per_s": bw}


def gpu_compute_constants() -> dict:
    """bf16 matmul FLOP/s (8192^3, random data) and device-to-device copy
    bandwidth (bytes read + written) of the current GPU, timed with CUDA events."""
    def timed(fn, reps: int = 10) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    return {"device": torch.cuda.get_device_name(), "bf16_matmul_flops_per_s": 2 * n**3 / timed(lambda: a @ b),
            "copy_bytes_per_s": 2 * x.numel() / timed(lambda: y.copy_(x))}


def _comm_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.config import comm
    from compiled_fsdp.core.comm import reduce_scatter_flat, uses_all_to_all

    fc = torch.ops._c10d_functional
    pg = torch.distributed.group.WORLD
    group = pg.group_name
    out: dict = {"all_gather": [], "reduce_scatter": [], "gloo_reduce_scatter_tensor": []}
    for nbytes in SIZES:
        full = torch.randn(nbytes // 4)
        shard = full[: full.numel() // world].clone()

        def ag() -> None:
            fc.wait_tensor(fc.all_gather_into_tensor(shard, world, group))

        def reduce() -> None:
            reduce_scatter_flat(full, pg, uses_all_to_all(pg, comm.gloo_reduce_by_all_to_all)).wait()

        def rs() -> None:
            fc.wait_tensor(fc.reduce_scatter_tensor(full, "sum", world, group))

        out["all_gather"].append((nbytes, median_s(ag, 15)))
        out["reduce_scatter"].append((nbytes, median_s(reduce, 15)))
        out["gloo_reduce_scatter_tensor"].append((nbytes, median_s(rs, 15)))
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of the *relative* error of t = alpha + bytes / beta (each
    point weighted 1/t^2, so small and large sizes count alike); returns
    (alpha_s, beta_bytes_per_s)."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max((sy - slope * sx) / sw, 0.0), 1.0 / slope


def main() -> None:
    if "--gpu" in sys.argv:
        c = gpu_compute_constants()
        print(f"{c['device']}: bf16 matmul {c['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, "
              f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written)")
        return
    from _dist import run_distributed

    comp = compute_constants()
    res = run_distributed(_comm_rank, 2)[0]
    print(f"matmul: {comp['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s (1 thread)")
    print(f"elementwise: {comp['elementwise_bytes_per_s'] / 1e9:.2f} GB/s (1 thread)")
    for kind, pts in res.items():
        alpha, beta = fit(pts)
        print(f"gloo {kind} (2 ranks): alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.3f} GB/s")
        for nbytes, t in pts:
            print(f"  {nbytes / 2**20:8.3f} MiB  {t * 1e3:8.3f} ms  fit {(alpha + nbytes / beta) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
