"""What the emulated benchmark's runs are priced with and linked by: the
compute each CPU worker declares to the passes, the host seconds a call of
the sharding's ops costs, and the matched link (benchmarks/emulated.py)."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

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


def priced_compute(args: argparse.Namespace, cfg: llama.LlamaConfig) -> Any:
    """The compute the passes price with on the CPU ([Note: Compute declared
    by the network] in passes/cost_model.py): measured here at the model's
    feed-forward and attention shapes and scaled to one block's compiled
    step, or ``--compute-gflops`` (and ``--attention-gflops``, else
    attention at the matmuls' rate); each host call at ``--host-call-us``
    ([Note: The sharding's host work priced per call]). None on CUDA and
    with 0."""
    from torch._inductor.utils import fresh_inductor_cache

    from compiled_fsdp.tools.cpu_compute import cpu_compute_at, measured_cpu_compute, step_calibrated

    if args.device != "cpu" or args.compute_gflops == 0:
        return None
    if args.compute_gflops is None:
        heads = (args.batch, cfg.n_heads, cfg.n_kv_heads, cfg.seq, cfg.dim // cfg.n_heads)
        rates = measured_cpu_compute(args.batch * cfg.seq, cfg.dim, cfg.ffn, attention=heads)
        # ([Note: Compute measured on the model's own step]: a block's, in this process)
        block, inputs = one_block(args, cfg, torch.device("cpu"), torch.float32, requires_grad=True)
        # (in a cache of its own: the run's first step reuses none of the block's kernels)
        with fresh_inductor_cache():
            rates = step_calibrated(block, *inputs, rates=rates)
        torch._dynamo.reset()  # (the block's compile is not the run's: counters and timers anew)
        torch._dynamo.utils.counters.clear()
        torch._dynamo.utils.compilation_time_metrics.clear()
    else:
        attention = args.attention_gflops * 1e9 if args.attention_gflops else None
        rates = cpu_compute_at(args.compute_gflops * 1e9, attention)
    host = 0.0 if args.host_call_us == "measure" else float(args.host_call_us)  # (measured later: the note below)
    return dataclasses.replace(rates, host_call_s=host * 1e-6)


# [Note: Host calls measured with collectives free]
# ``--host-call-us measure`` (CPU): each of ours' workers compiles its model
# first on a free network (every collective priced at nothing, the compute
# it measured declared), runs the warm-up and three steps more, and prices
# each host call at what those steps left unpriced: the median step, less
# the optimizer's step and the compute its timeline priced, over the host
# calls the timeline counted (``host_calls_measured``). It then declares that
# on the run's network and compiles again (``torch._dynamo.reset()``), so
# that the run's schedule and its prediction are priced with it; the first
# step reported is the first compile's. With collectives free nothing is
# communicated or exposed, so this measures the sharding's work on the host,
# not the network; what the run then checks is where the timeline puts
# communication against that compute. Measured in the worker itself because
# processes of one configuration run at speeds 20-30% apart on this machine:
# carried from a run of its own at the free link (the first try), the figure
# was 0 us a call in one process and 726 in another, and the predictions were
# 0.94-1.39x the measured (RESULTS, 2026-12-05). Tested by
# tests/test_emulated.py::test_benchmark_cpu_path.
def host_calls_measured(args: argparse.Namespace, timed: Callable[[int], float], optimizer: list[float],
                        predicted: dict[str, Any], compute: Any) -> tuple[Any, float]:
    """``compute`` with each host call priced (see the note), and the
    seconds a step left unpriced: ``timed(i)`` runs and times step ``i`` on
    the free network, ``optimizer`` collects each step's optimizer time,
    ``predicted`` is the free compile's ``_prediction``."""
    if not predicted.get("predicted_host_calls"):
        raise RuntimeError(f"--host-call-us measure: the free compile left no prediction with host calls to price "
                           f"({sorted(predicted)}): was the model compiled whole (kind {args.kind!r})?")
    for i in range(1, args.warmup):
        timed(i)
    optimizer.clear()
    step = statistics.median(timed(args.warmup + i) for i in range(3))
    unpriced = step - statistics.median(optimizer) - predicted["predicted_compute_s"]
    # (none where the compute priced more than the steps took: a calibration on a faster moment)
    return dataclasses.replace(compute, host_call_s=max(0.0, unpriced / predicted["predicted_host_calls"])), unpriced
