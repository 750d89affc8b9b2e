"""The compute a CPU run declares to the cost model ([Note: Compute declared
by the network] in passes/cost_model.py): this machine's matmul rate, and
its attention's, measured at a model's own shapes, for the emulated
network's ``Topology.compute`` (tools/emulated.py)."""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from compiled_fsdp.passes.cost_model import CPU_COMPUTE, ComputeConstants

__all__ = ["cpu_compute_at", "measured_cpu_compute", "median_s"]


def cpu_compute_at(flops_per_s: float, attention_flops_per_s: float | None = None) -> ComputeConstants:
    """The cost model's CPU constants for a machine whose matmuls run at
    ``flops_per_s``, for ``Topology.compute``: the memory rates scaled by
    the same ratio (one core's rates move together; the elementwise one alone
    swings too much on a shared machine to measure in a second); fused
    attention at its own rate where given ([Note: Attention's own rate] in
    passes/cost_model.py)."""
    scale = flops_per_s / CPU_COMPUTE.flops_per_s
    return dataclasses.replace(CPU_COMPUTE, flops_per_s=flops_per_s, bytes_per_s=CPU_COMPUTE.bytes_per_s * scale,
                               host_bytes_per_s=CPU_COMPUTE.host_bytes_per_s * scale,
                               attention_flops_per_s=attention_flops_per_s)


def median_s(fn: Callable[[], object], reps: int) -> float:
    """The median seconds of ``reps`` calls of ``fn``, after one unmeasured
    (benchmarks/calibrate.py's too)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _attention_rate(shape: tuple[int, int, int, int, int], reps: int) -> float | None:
    """FLOP/s of causal ``scaled_dot_product_attention``, forward and
    backward, at ``(batch, heads, kv_heads, seq, head_dim)``, its FLOPs as
    torch's flop counter counts them (None where it counts none: the op
    the CPU runs is not registered on every torch)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, heads, kv_heads, seq, head_dim = shape
    q = torch.randn(batch, heads, seq, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, requires_grad=True) for _ in range(2))

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    counter = FlopCounterMode(display=False)
    with counter:
        run()
    flops = counter.get_total_flops()
    return flops / median_s(run, reps) if flops else None


def measured_cpu_compute(m: int, k: int, n: int, reps: int = 15,
                         attention: tuple[int, int, int, int, int] | None = None) -> ComputeConstants:
    """``cpu_compute_at`` this machine's rate of an ``[m, k] @ [k, n]``
    matmul (a model's own shape: its tokens, width and feed-forward width),
    the median of ``reps``, on the threads set; and of its attention at
    ``attention`` = (batch, heads, kv_heads, seq, head_dim), if given."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    rate = 2 * m * k * n / median_s(lambda: a @ b, reps)
    return cpu_compute_at(rate, _attention_rate(attention, reps) if attention is not None else None)
