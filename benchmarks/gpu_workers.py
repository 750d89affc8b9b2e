"""One configuration of the GPU check, run in a process of its own
(``benchmarks/gpu_check.py`` starts them; each writes one JSON result).

Kinds (see gpu_check.py's docstring for what each row means):
  floor            the unsharded model compiled whole (Inductor), parameters
                   cast to bf16 inside the graph: the compute-only floor
  ours_compiled    compiled_fsdp, fully_shard per block + root, torch.compile(model)
  ours_eager       compiled_fsdp's eager runtime
  fsdp2_blocks     FSDP2 (torch.distributed.fsdp.fully_shard), each block compiled
  sim_ours         ours_compiled under the fake process group at --sim-world ranks
  sim_fsdp2        fsdp2_blocks under the same fake group
  block_times      one block and the head of the simulated model, unsharded and
                   compiled, timed forward and backward (the timeline prediction's input)
  f8_ours_compiled torchao float8 linears (not the output), torch.compile(model):
                   the cast moved before each in-graph gather ([Note: Float8
                   weights cast before their gather in graphs])
  f8_ours_blocks   torchao float8 linears (not the output), gathered as float8,
                   each block compiled on its own (torchao's scale precompute
                   after each step); real float8 matmuls on the GPU
  f8_fsdp2_blocks  the same under FSDP2
  offload_ours_blocks / offload_fsdp2_blocks
                   CPUOffloadPolicy(), each block compiled on its own: shards,
                   gradients and AdamW on the CPU
  offload_ours_compiled
                   the same, the whole model compiled: each shard copied to the
                   GPU inside the graph, with its gather ([Note: CPU offload in
                   graphs])
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import llama  # noqa: E402

WS1_KINDS = ("floor", "ours_compiled", "ours_onegraph", "ours_eager", "fsdp2_blocks")
SIM_KINDS = ("sim_ours", "sim_fsdp2")
F8_OFFLOAD_KINDS = ("f8_ours_compiled", "f8_ours_blocks", "f8_fsdp2_blocks", "offload_ours_compiled",
                    "offload_ours_blocks", "offload_fsdp2_blocks")
KINDS = WS1_KINDS + SIM_KINDS + F8_OFFLOAD_KINDS + ("block_times",)


def model_config(args: argparse.Namespace, sim: bool) -> llama.LlamaConfig:
    if args.quick:  # CPU tests: tiny dimensions, the same code paths
        cfg = llama.LLAMA_TINY
        return cfg.with_(checkpoint_blocks=True) if sim else cfg
    if sim:
        return llama.LLAMA_3_1_8B.with_(seq=args.sim_seq, checkpoint_blocks=True)
    return llama.LLAMA_1B.with_(seq=args.seq)


def _init_group(device: torch.device, sim_world: int | None) -> None:
    if sim_world is not None:  # one process plays rank 0 of sim_world; collectives move nothing
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=sim_world, store=FakeStore())
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mp_policies():
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MP

    from compiled_fsdp import MixedPrecisionPolicy

    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(**kw), FSDP2MP(**kw)


class _BF16Floor(nn.Module):
    """The unsharded model, computed on bf16 copies of its fp32 parameters
    (what mixed precision gathers), gradients back into fp32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        params = {k: v.to(torch.bfloat16) for k, v in self.model.named_parameters()}
        return torch.func.functional_call(self.model, params, (tokens,))


def build(kind: str, cfg: llama.LlamaConfig, device: torch.device, backend: str) -> tuple[nn.Module, Callable]:
    """The model (fp32 parameters, sharded as ``kind`` says) and what a step calls."""
    ours_mp, fsdp2_mp = _mp_policies()
    sim = kind in SIM_KINDS
    if sim:  # built on meta, sharded, materialized: 1/W of the parameters ever exist
        with torch.device("meta"):
            model = llama.Llama(cfg)
    else:
        torch.manual_seed(0)
        # (CPU offload: built on the CPU, as a model larger than the GPU is; its
        # rotary tables are buffers that fully_shard moves to the GPU)
        with torch.device("cpu" if kind.startswith("offload_") else device):
            model = llama.Llama(cfg)
    if kind == "floor":
        return model, torch.compile(_BF16Floor(model), backend=backend)
    if kind in F8_OFFLOAD_KINDS:
        return _build_f8_offload(kind, model, backend, device)
    if kind in ("ours_compiled", "ours_onegraph", "ours_eager", "sim_ours"):
        import compiled_fsdp
        from compiled_fsdp import fully_shard

        # (the default: each block a compile region; ours_onegraph: the whole model one graph)
        compiled_fsdp.config.comm.block_regions = kind != "ours_onegraph"
        for block in model.layers:
            fully_shard(block, mp_policy=ours_mp)
        fully_shard(model, mp_policy=ours_mp)
        run = model if kind == "ours_eager" else torch.compile(model, backend=backend)
    elif kind in ("fsdp2_blocks", "sim_fsdp2"):
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
        for block in model.layers:  # torchtitan's order: compile each block, then shard
            block.compile(backend=backend)
            fsdp2_fully_shard(block, mp_policy=fsdp2_mp)
        fsdp2_fully_shard(model, mp_policy=fsdp2_mp)
        run = model
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if sim:
        model.to_empty(device=device)
        model.init_weights()
    return model, run


def _build_f8_offload(kind: str, model: nn.Module, backend: str, device: torch.device
                      ) -> tuple[nn.Module, Callable]:
    """torchtitan's per-block pattern with float8 all-gather or CPU offload,
    under ours or FSDP2 (same mixed precision as the other rows)."""
    ours_mp, fsdp2_mp = _mp_policies()
    kw: dict[str, Any] = {}
    if kind.startswith("f8_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
    if "_ours_" in kind:
        from compiled_fsdp import CPUOffloadPolicy, fully_shard

        shard, mp = fully_shard, ours_mp
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        shard, mp = fully_shard, fsdp2_mp
    if kind.startswith("offload_"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    whole = kind.endswith("_compiled")
    for block in model.layers:
        if not whole:
            block.compile(backend=backend)
        shard(block, mp_policy=mp, **kw)
    shard(model, mp_policy=mp, **kw)
    return model, torch.compile(model, backend=backend) if whole else model


def _after_optimizer(kind: str, model: nn.Module) -> None:
    """torchao's float8 recipe: one all-reduce of the amaxes after each optimizer step."""
    if kind.startswith("f8_"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _param_norm(model: nn.Module) -> float:
    return float(sum(_local(p).detach().float().pow(2).sum() for p in model.parameters()).sqrt())


def measure(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    sim = kind in SIM_KINDS
    world = args.sim_world if sim else 1
    cfg = model_config(args, sim)
    batch = args.sim_batch if sim else args.batch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, run = build(kind, cfg, device, args.backend)
    params_full = sum(p.numel() for p in model.parameters())
    params_local = sum(_local(p).numel() for p in model.parameters())
    on_device = all(_local(p).device.type == device.type for p in model.parameters())  # (not offloaded)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda" and on_device)

    def step(i: int) -> torch.Tensor:
        tokens = llama.batch(cfg, batch, seed=i, device=device)
        loss = llama.loss_fn(run(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _after_optimizer(kind, model)
        return loss.detach()

    losses, times, allocated = [], [], []
    t0 = time.perf_counter()
    losses.append(float(step(0)))
    _sync(device)
    first_step_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        losses.append(float(step(i)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup, args.warmup + args.steps):
        _sync(device)
        t = time.perf_counter()
        loss = step(i)
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if device.type == "cuda":  # after each step: must not grow
            allocated.append(torch.cuda.memory_allocated() / 2**30)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    trace = None
    if args.trace_dir and kind in args.trace_kinds:
        trace = _trace_one_step(step, args.warmup + args.steps, device, args.trace_dir, kind)
    step_s = statistics.median(times)
    tokens = batch * cfg.seq
    flops_token = model.flops_per_token()
    return {
        "kind": kind, "world": world, "device": str(device), "backend": args.backend,
        "config": cfg.__dict__, "batch": batch, "params_full": params_full, "params_local": params_local,
        "first_step_s": first_step_s, "step_s": step_s, "step_times_s": times,
        "tokens_per_s": tokens / step_s, "flops_per_token": flops_token,
        "mfu": tokens / step_s * flops_token / args.peak_flops,
        "peak_mem_gib": peak, "allocated_after_step_gib": allocated, "losses": losses,
        "param_norm": _param_norm(model), "trace": trace,
        "offload": _offload_placement(model) if kind.startswith("offload_") else None,
    }


def _offload_placement(model: nn.Module) -> dict[str, Any]:
    """Where the shards live after training, and whether pinned: what the
    CPU tests cannot show ([Note: CPU offload] in compiled_fsdp/runtime/policy.py)."""
    locals_ = [_local(p) for p in model.parameters()]
    return {"shard_devices": sorted({t.device.type for t in locals_}),
            "all_pinned": all(t.is_pinned() for t in locals_)}


def _trace_one_step(step: Callable, i: int, device: torch.device, out_dir: str, kind: str) -> str:
    """A Perfetto-readable Chrome trace (gzipped JSON) of one step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(i)
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        path = os.path.join(out_dir, f"trace_{kind}.json.gz")
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return path


def block_times(args: argparse.Namespace) -> dict[str, Any]:
    """Forward and backward seconds of one checkpointed block and of the head
    (norm, output, loss), bf16, unsharded, compiled: what each rank computes
    per module in the simulated job."""
    device = torch.device(args.device)
    cfg = model_config(args, sim=True)
    x_shape = (args.sim_batch, cfg.seq, cfg.dim)
    torch.manual_seed(0)
    with torch.device(device):
        block = llama.Block(cfg).to(torch.bfloat16)
        head = nn.Sequential(nn.RMSNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab, bias=False)).to(torch.bfloat16)
        cos, sin = llama.rope_tables(cfg, device)
    tokens = llama.batch(cfg, args.sim_batch, 0, device)
    fblock = torch.compile(lambda x: block(x, cos, sin), backend=args.backend)
    fhead = torch.compile(lambda x: llama.loss_fn(head(x), tokens), backend=args.backend)

    def timed(fn: Callable, backward: bool) -> float:
        ts = []
        for i in range(args.warmup + args.steps):
            x = torch.randn(x_shape, device=device, dtype=torch.bfloat16, requires_grad=True)
            _sync(device)
            t = time.perf_counter()
            out = fn(x)
            if backward:
                out.float().sum().backward() if out.dim() else out.backward()
            _sync(device)
            if i >= args.warmup:
                ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    res = {"kind": "block_times", "config": cfg.__dict__, "batch": args.sim_batch}
    for name, fn in (("block", fblock), ("head", fhead)):
        fwd = timed(fn, False)
        res[f"{name}_fwd_s"], res[f"{name}_bwd_s"] = fwd, timed(fn, True) - fwd
    res["block_param_bytes"] = sum(p.numel() for p in block.parameters()) * 4  # fp32 master
    res["head_param_bytes"] = (cfg.vocab * cfg.dim + cfg.dim) * 4
    res["embed_param_bytes"] = cfg.vocab * cfg.dim * 4
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--quick", action="store_true", help="tiny models (the CPU tests)")
    p.add_argument("--seq", type=int, default=2048, help="world-size-1 sequence length")
    p.add_argument("--batch", type=int, default=4, help="world-size-1 batch")
    p.add_argument("--sim-world", type=int, default=8, help="ranks of the simulated job (fake process group)")
    p.add_argument("--sim-seq", type=int, default=8192)
    p.add_argument("--sim-batch", type=int, default=1, help="local batch of the simulated job")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--peak-flops", type=float, default=989e12,
                   help="the GPU's dense bf16 FLOP/s for MFU (H100/H200 SXM datasheet: 989 TFLOP/s)")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--trace-kinds", nargs="*", default=["ours_compiled"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--result", required=True, help="where to write this configuration's JSON")
    add_arguments(p)
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    if args.kind == "block_times":
        res = block_times(args)
    else:
        _init_group(torch.device(args.device), args.sim_world if args.kind in SIM_KINDS else None)
        try:
            res = measure(args.kind, args)
        finally:
            dist.destroy_process_group()
    with open(args.result, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
