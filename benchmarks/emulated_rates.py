"""What the emulated benchmark's runs are priced with and linked by: the
compute each CPU worker declares to the passes, the host seconds a call of
the sharding's ops costs, and the matched link (benchmarks/emulated.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any, Optional

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

    from compiled_fsdp.passes.cost_model import ComputeConstants
    from compiled_fsdp.tools.cpu_compute import cpu_compute_at, measured_cpu_compute, step_calibrated

    if args.rates:  # ([Note: Host calls measured with collectives free]: a free run's, as it declared them)
        return ComputeConstants(**json.loads(args.rates))
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
    return dataclasses.replace(rates, host_call_s=float(args.host_call_us) * 1e-6)


# [Note: Host calls measured with collectives free]
# ``--host-call-us auto`` (CPU) runs the free link first, at each world, and
# each kind's runs at the other links declare the compute its own free run
# declared, with each host call priced at what that run left unpriced: its
# step, less its optimizer's step and the compute its timeline priced, over
# the host calls the timeline counted (``rates_from_free``). With
# collectives free nothing is communicated or exposed, so this measures the
# sharding's work on the host, not the network; what the other links' runs
# then check is where the timeline puts communication against that compute.
# The rates go with it because each worker's calibration of them moves by
# more than the host work: in one run the free workers at W=8 priced the
# matmuls at 1.31e11 FLOP/s (ours) and 1.47e11 (regions), which left 62
# and 613 us a host call. Tested by
# tests/test_emulated.py::test_host_calls_measured_with_collectives_free.
def rates_from_free(free: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The compute a free run declared, its host calls priced (see the
    note); None where the run has no prediction (not ours) or failed."""
    calls = free.get("predicted_host_calls")
    if not calls or "step_s" not in free:
        return None
    unpriced = free["step_s"] - free["optimizer_s"] - free["predicted_compute_s"]
    return {**free["topology"]["compute"], "host_call_s": max(0.0, unpriced / calls)}
