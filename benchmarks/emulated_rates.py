"""What the emulated benchmark's runs are priced with and linked by: the
compute each CPU worker declares to the passes, the host seconds a call of
the sharding's ops costs, and the matched link (benchmarks/emulated.py)."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable, Optional

import llama
import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_block(args: argparse.Namespace, cfg: llama.LlamaConfig, device: torch.device, dtype: torch.dtype,
              requires_grad: bool = False) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """One of the model's blocks, unsharded, in ``dtype`` (seed 0), and its
    inputs: a local batch's activations and the rope tables."""
    torch.manual_seed(0)
    with torch.device(device):
        block = llama.Block(cfg.with_(checkpoint_blocks=False)).to(dtype)
        cos, sin = llama.rope_tables(cfg, device)
    x = torch.randn(args.batch, cfg.seq, cfg.dim, device=device, dtype=dtype, requires_grad=requires_grad)
    return block, (x, cos, sin)


def match_gbps(args: argparse.Namespace, cfg: llama.LlamaConfig, world: int) -> float:
    """Link GB/s at which one block's all-gather (its parameters in the
    compute dtype, a ring over ``world``) takes as long as the block's
    forward, measured here unsharded and compiled."""
    device = torch.device(args.device)
    block, (x, cos, sin) = one_block(args, cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    fwd = torch.compile(lambda x: block(x, cos, sin))
    with torch.no_grad():
        for _ in range(2):
            fwd(x)
        ts = []
        for _ in range(5):
            sync(device)
            t = time.perf_counter()
            fwd(x)
            sync(device)
            ts.append(time.perf_counter() - t)
    nbytes = sum(p.numel() * p.element_size() for p in block.parameters())
    return (world - 1) / world * nbytes / statistics.median(ts) / 1e9


class BlockClock:
    """How fast this process computes now: the seconds of one eager forward
    and backward of ``block`` on ``inputs`` (the block the rates are
    calibrated on, run as it is, not compiled), against those it took while
    the rates were calibrated (``reference_s``). [Note: The block's clock
    beside each priced step]."""

    def __init__(self, block: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        self.block, self.inputs = block, inputs
        self.reference_s: Optional[float] = None

    def __call__(self) -> float:
        t = time.perf_counter()
        self.block(*self.inputs).sum().backward()
        t = time.perf_counter() - t
        self.block.zero_grad(set_to_none=True)  # (none left between reads)
        self.inputs[0].grad = None
        return t

    def speed(self) -> float:
        """Now against the calibration: above 1 where this process runs slower."""
        assert self.reference_s is not None, "the clock was read before the rates were calibrated"
        return self() / self.reference_s


def priced_compute(args: argparse.Namespace, cfg: llama.LlamaConfig) -> tuple[Any, Optional[BlockClock]]:
    """The compute the passes price with on the CPU ([Note: Compute declared
    by the network] in passes/cost_model.py): measured here at the model's
    feed-forward and attention shapes and scaled to one block's compiled
    step, or ``--compute-gflops`` (and ``--attention-gflops``, else
    attention at the matmuls' rate); each host call at ``--host-call-us``
    ([Note: The sharding's host work priced per call]). None on CUDA and
    with 0. Beside it the block's clock, read beside each calibrating step
    (None but in ours' workers under ``--host-call-us measure``)."""
    from torch._inductor.utils import fresh_inductor_cache

    from compiled_fsdp.tools.cpu_compute import cpu_compute_at, measured_cpu_compute, median_s, step_calibrated

    if args.device != "cpu" or args.compute_gflops == 0:
        return None, None
    clock: Optional[BlockClock] = None
    if args.compute_gflops is None:
        heads = (args.batch, cfg.n_heads, cfg.n_kv_heads, cfg.seq, cfg.dim // cfg.n_heads)
        rates = measured_cpu_compute(args.batch * cfg.seq, cfg.dim, cfg.ffn, attention=heads)
        # ([Note: Compute measured on the model's own step]: a block's, in this process)
        block, inputs = one_block(args, cfg, torch.device("cpu"), torch.float32, requires_grad=True)
        # (a clock where the host calls will be measured: [Note: The block's clock beside each priced step])
        if args.host_call_us == "measure" and args.kind in ("ours", "ours_regions"):
            clock = BlockClock(block, inputs)
        timer = (lambda step, reps: _beside(clock, step, reps)) if clock is not None else median_s
        # (in a cache of its own: the run's first step reuses none of the block's kernels)
        with fresh_inductor_cache():
            rates = step_calibrated(block, *inputs, rates=rates, timer=timer)
        torch._dynamo.reset()  # (the block's compile is not the run's: counters and timers anew)
        torch._dynamo.utils.counters.clear()
        torch._dynamo.utils.compilation_time_metrics.clear()
    else:
        attention = args.attention_gflops * 1e9 if args.attention_gflops else None
        rates = cpu_compute_at(args.compute_gflops * 1e9, attention)
    host = 0.0 if args.host_call_us == "measure" else float(args.host_call_us)  # (measured later: the note below)
    return dataclasses.replace(rates, host_call_s=host * 1e-6), clock


def _beside(clock: BlockClock, step: Callable[[], object], reps: int) -> float:
    """``step``'s median seconds over ``reps`` (after one unmeasured, as
    ``cpu_compute.median_s``), the clock read after each: its median is the
    clock's reference."""
    step()
    clock()
    times, reads = [], []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        reads.append(clock())
    clock.reference_s = statistics.median(reads)
    return statistics.median(times)


# [Note: Host calls measured with collectives free]
# ``--host-call-us measure`` (CPU): each of ours' workers compiles its model
# first on a free network (every collective priced at nothing, the compute
# it measured declared), runs the warm-up and three steps more, and prices
# each host call at what those steps left unpriced: each step less its
# optimizer's step and the compute its timeline priced, over the host calls
# the timeline counted, the median of the three (``host_calls_measured``).
# It then declares that on the run's network and compiles again
# (``torch._dynamo.reset()``), so that the run's schedule and its prediction
# are priced with it; the first step reported is the first compile's. With
# collectives free nothing is communicated or exposed, so this measures the
# sharding's work on the host, not the network; what the run then checks is
# where the timeline puts communication against that compute. Measured in
# the worker itself because processes of one configuration run at speeds
# 20-30% apart on this machine: carried from a run of its own at the free
# link (the first try), the figure was 0 us a call in one process and 726
# in another, and the predictions were 0.94-1.39x the measured (RESULTS,
# 2026-12-05). Tested by tests/test_emulated.py::test_benchmark_cpu_path.
#
# [Note: The block's clock beside each priced step]
# Within one process the speed moves too: of eight workers measured so, two
# calibrated their rates in a fast moment (144 and 146 GFLOP/s, where the
# others had 80-112) and ran their free steps in a slow one, so the
# slowness was priced as host calls (2.4 and 3.5 ms a call, the others
# 0.2-0.6 ms), and their predictions fell to 0.72x and 0.73x the measured
# (RESULTS, 2026-12-05). So a clock, one eager forward and backward of the
# model's block (``BlockClock``), is read after each calibrating step (its
# median the reference) and after each free step: each free step's compute
# is priced at the speed its clock read (``speed``: its reading over the
# reference), and the rates the run declares are the calibrated ones at the
# free steps' median speed (``cpu_compute.scaled_rates``). Where the rates
# were given (``--compute-gflops``) there is no clock and no scaling. The
# results give the free steps' median speed (``priced_speed``); the rates
# reported (``priced_flops_per_s``) are those the run declared.
def host_calls_measured(args: argparse.Namespace, timed: Callable[[int], float], optimizer: list[float],
                        predicted: dict[str, Any], compute: Any,
                        clock: Optional[BlockClock]) -> tuple[Any, float, float]:
    """``compute`` with each host call priced, at the free steps' speed (the
    notes above), the seconds a step left unpriced and that speed (1 without
    a clock): ``timed(i)`` runs and times step ``i`` on the free network,
    ``optimizer`` collects each step's optimizer time, ``predicted`` is the
    free compile's ``_prediction``."""
    from compiled_fsdp.tools.cpu_compute import scaled_rates

    calls = predicted.get("predicted_host_calls")
    if not calls:
        raise RuntimeError(f"--host-call-us measure: the free compile left no prediction with host calls to price "
                           f"({sorted(predicted)}): was the model compiled whole (kind {args.kind!r})?")
    for i in range(1, args.warmup):
        timed(i)
    unpriced, speeds = [], []
    for i in range(3):
        step = timed(args.warmup + i)
        speeds.append(clock.speed() if clock is not None else 1.0)
        unpriced.append(step - optimizer[-1] - predicted["predicted_compute_s"] * speeds[-1])
    speed, left = statistics.median(speeds), statistics.median(unpriced)
    # (none where the compute priced more than the steps took)
    return dataclasses.replace(scaled_rates(compute, 1 / speed), host_call_s=max(0.0, left / calls)), left, speed
