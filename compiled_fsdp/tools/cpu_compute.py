"""The compute a CPU run declares to the cost model ([Note: Compute declared
by the network] in passes/cost_model.py): this machine's matmul rate, and
its attention's, measured at a model's own shapes, and those rates scaled
to what a model's own compiled step takes here ([Note: Compute measured on
the model's own step]), for the emulated network's ``Topology.compute``
(tools/emulated.py)."""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_leaves

from compiled_fsdp.core import compat
from compiled_fsdp.passes.cost_model import CPU_COMPUTE, ComputeConstants, CostModel

__all__ = ["cpu_compute_at", "measured_cpu_compute", "median_s", "scaled_rates", "step_calibrated"]


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


# [Note: Compute measured on the model's own step]
# The rates above are measured op by op, each on the same inputs again and
# again, its operands warm in the cache. A training step runs the same ops
# slower: on this project's CPU (one thread, the emulated benchmark's
# Llama, 2026-12-05) the floor's 171 matmuls took 311 ms in the step where
# the measured rate priced 259-280 ms, and the copies and fused kernels
# around them ran at about 14 GB/s where the scaled memory rate priced 19.
# A sharded step's forward was priced at 143 ms and took 182, its backward
# at 266 ms and took 312, so the timeline had each block's compute 20-35%
# shorter than the run's. At the matched link, where a block's compute and
# its gather take about as long, that decides whether a gather waits: the
# prediction of the exposed communication was 1.67-2.04x the measured one
# (RESULTS, 2026-12-04). So ``step_calibrated`` compiles a model (the
# unsharded one, or a block), prices its forward and backward graphs with
# the given rates, times the compiled step, and scales every rate by the
# ratio: the rates keep their proportions, measured op by op, and together
# price the step the model takes here. Tested by
# tests/test_emulated.py::test_step_calibrated_prices_the_step_measured.
class _Priced(CustomGraphPass):
    """A post-grad pass that prices each graph Inductor compiles and changes
    nothing (``uuid`` None: no cached graph skips it)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost, self.seconds = cost, []

    def __call__(self, graph: fx.Graph) -> None:
        self.seconds.append(sum(self.cost.compute_time(n) for n in graph.nodes))

    def uuid(self) -> None:
        return None


def step_calibrated(module: nn.Module, *inputs: object, rates: ComputeConstants, reps: int = 5,
                    timer: Callable[[Callable[[], object], int], float] = median_s) -> ComputeConstants:
    """``rates`` scaled so that the cost model prices ``module``'s compiled
    forward and backward (Inductor; a gradient of ones on its outputs that
    need one) at the seconds they take here: ``timer(step, reps)``, by
    default the median of ``reps`` after two unmeasured ([Note: Compute
    measured on the model's own step])."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    priced = _Priced(CostModel(compute=dataclasses.replace(rates, host_call_s=0.0)))  # (the rates' work alone)
    needs_grad = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]

    def no_grads() -> None:  # (each step's gradients fresh, as a training step's; none left behind)
        module.zero_grad(set_to_none=True)
        for t in needs_grad:
            t.grad = None

    def inductor(gm: fx.GraphModule, example_inputs: list) -> Callable:
        return compile_fx(gm, example_inputs)

    # (a backend of its own: Dynamo compiles anew what it compiled before
    # with another, so the pass sees the graphs even of a module compiled already)
    compiled = torch.compile(module, backend=inductor, dynamic=False)

    def step() -> None:
        no_grads()
        outs = [t for t in tree_leaves(compiled(*inputs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    passes = compat.post_grad_passes(inductor_config.post_grad_custom_post_pass)
    try:
        with inductor_config.patch(post_grad_custom_post_pass=compat.post_grad_value((*passes, priced)),
                                   fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            step()
        if len(priced.seconds) != 2:
            raise RuntimeError(f"step_calibrated: the module compiled into {len(priced.seconds)} graphs, not "
                               f"one forward and one backward (a graph break, no output that needs a "
                               f"gradient, or a frame Dynamo would not compile again): calibrate on a module "
                               f"that compiles whole")
        scale = sum(priced.seconds) / timer(step, reps)
    finally:
        no_grads()
    return scaled_rates(rates, scale)


def scaled_rates(rates: ComputeConstants, factor: float) -> ComputeConstants:
    """Every rate of ``rates`` times ``factor``, in proportion (the host call's price unchanged)."""
    return dataclasses.replace(
        rates, flops_per_s=rates.flops_per_s * factor, bytes_per_s=rates.bytes_per_s * factor,
        host_bytes_per_s=rates.host_bytes_per_s * factor,
        attention_flops_per_s=rates.attention_flops_per_s * factor if rates.attention_flops_per_s else None)
