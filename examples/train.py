"""Train a byte-level GPT on real text with compiled_fsdp under torchrun: the README's main job.

    torchrun --nproc-per-node 2 examples/train.py                  # Inductor, the stdlib corpus
    torchrun --nproc-per-node 2 examples/train.py --compile none   # eager hook runtime
    torchrun --nproc-per-node 2 examples/train.py --compile-blocks # each block compiled on its own
    torchrun --nproc-per-node 4 examples/train.py --hsdp 2         # HSDP: 2 replicas x 2 shards
    torchrun --nproc-per-node 2 examples/train.py --impl fsdp2     # PyTorch's FSDP2, blocks compiled
    torchrun --nproc-per-node 2 examples/train.py --compare        # ours, then FSDP2: one PNG
    python examples/train.py --impl single --batch 8               # one process, no sharding
    torchrun --nproc-per-node 2 examples/train.py --checkpoint-dir ckpt --checkpoint-every 50
    torchrun --nproc-per-node 2 examples/train.py --checkpoint-dir ckpt --resume   # any world size
    TORCH_CACHING_PRECOMPILE=1 torchrun --nproc-per-node 2 examples/train.py  # again: no trace (torch 2.15)

The text is Python's standard library (no download) or ``--data DIR|GLOB``,
byte tokens, split into training and validation by file (examples/data.py).
Each rank reads its own batches (``DistributedSampler`` order: the same after a
restart). Parameters are gathered and used in bf16 and gradients reduced in
fp32 (``--precision fp32`` turns it off); each step accumulates
``--micro-batches`` backward passes and reduces on the last
(``set_requires_gradient_sync``). Rank 0 prints a line every ``--log-every``
steps and writes ``OUT/metrics-IMPL.jsonl`` and ``OUT/train-IMPL.png``.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed import fsdp as torch_fsdp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import compiled_fsdp  # noqa: E402
from examples import checkpoint, data, gpt, metrics  # noqa: E402

MODELS = {  # byte tokens: vocab 256
    "tiny": gpt.GPTConfig(vocab=256, dim=32, n_layers=2, n_heads=2, seq=64),
    "small": gpt.GPTConfig(vocab=256, dim=128, n_layers=4, n_heads=4, seq=128),
    "bench": gpt.GPTConfig(vocab=256, dim=512, n_layers=8, n_heads=8, seq=256),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--impl", default="ours", choices=["ours", "fsdp2", "single"],
                   help="ours: compiled_fsdp; fsdp2: torch.distributed.fsdp.fully_shard, each block compiled "
                        "(torchtitan's pattern); single: one process, no sharding")
    p.add_argument("--compare", action="store_true", help="train ours, then FSDP2, same seed: one PNG")
    p.add_argument("--data", default=None, help="a folder or glob of UTF-8 text files (default: the stdlib)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="backward passes per optimizer step (gradient sync on the last only)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak; linear warm-up, cosine decay to 10%%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default="inductor", choices=["inductor", "aot_eager", "none"])
    p.add_argument("--compile-blocks", action="store_true",
                   help="compile each block on its own (block.compile()), the root eager")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="bf16: gather and compute in bf16, reduce in fp32 (default)")
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="HSDP: R replicas, each sharded over world/R ranks (a 2-D mesh; default: 1-D)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every M steps (and the last)")
    p.add_argument("--val-batches", type=int, default=4, help="validation batches per rank")
    p.add_argument("--out", default="out", help="folder for metrics-IMPL.jsonl and the PNGs")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (0: only with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    # Tests only: stop making progress at this step (the kill-and-resume test SIGKILLs the job there).
    p.add_argument("--stall-at-step", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.compare and args.impl != "ours":
        p.error("--compare runs both ours and fsdp2: leave --impl out")
    return args


def init_distributed() -> torch.device:
    """torchrun's environment, or a world of one for ``python examples/train.py``."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def build(args: argparse.Namespace, impl: str, cfg: gpt.GPTConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """The model (same seed for every impl), what a step calls, the optimizer."""
    world = dist.get_world_size()
    torch.manual_seed(args.seed)
    model = gpt.GPT(cfg).to(device)
    backend = {"inductor": "inductor", "aot_eager": "aot_eager", "none": None}[args.compile]
    if impl == "single":
        if world != 1:
            raise ValueError(f"--impl single runs one process, not {world}: launch it with python (or "
                             f"--nproc-per-node 1) and --batch {args.batch * world} for the same global batch")
        step_fn = torch.compile(model, backend=backend) if backend else model
    else:
        api = compiled_fsdp if impl == "ours" else torch_fsdp
        mesh = None
        if args.hsdp:
            if world % args.hsdp:
                raise ValueError(f"--hsdp {args.hsdp}: the world size {world} must be a multiple of R")
            mesh = init_device_mesh(device.type, (args.hsdp, world // args.hsdp),
                                    mesh_dim_names=("replicate", "shard"))
        mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.precision == "bf16" else api.MixedPrecisionPolicy()
        kw = dict(mesh=mesh, reshard_after_forward=not args.no_reshard, mp_policy=mp)
        for block in model.layers:
            api.fully_shard(block, **kw)
        api.fully_shard(model, **kw)
        step_fn = model
        if backend and (impl == "fsdp2" or args.compile_blocks):
            for block in model.layers:
                block.compile(backend=backend)
        elif backend:
            step_fn = torch.compile(model, backend=backend)
    # fused: one kernel per step instead of one DTensor dispatch per tensor and op (DESIGN.md)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return model, step_fn, opt


def lr_at(args: argparse.Namespace, step: int) -> float:
    warm = max(1, min(20, args.steps // 10))
    if step <= warm:
        return args.lr * step / warm
    frac = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def evaluate(model: torch.nn.Module, batches: list, device: torch.device, autocast: Any) -> float:
    """Mean validation loss over every rank's fixed batches (the eager module:
    evaluation needs no graph of its own)."""
    total = torch.zeros((), device=device)
    with torch.no_grad(), autocast:
        for x, y in batches:
            logits = model(x.to(device))
            total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


def digest(model: torch.nn.Module) -> str:
    """A hash of every rank's parameter bytes, in rank order (equal digests:
    bitwise equal parameters at one world size)."""
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        h.update(local.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, h.hexdigest())
    return hashlib.sha256("".join(every).encode()).hexdigest()[:16]


def save_traces() -> bool:
    """Under torch's caching precompile (``TORCH_CACHING_PRECOMPILE=1``): the
    traces compiled so far are saved beside Inductor's caches, and the next
    job, sharded alike, loads them instead of tracing (README, "A job started
    again can skip Dynamo's trace"). Called after the first step and the last."""
    if os.environ.get("TORCH_CACHING_PRECOMPILE") == "1":
        torch.compiler.save_cache_artifacts()
    return True


def train(args: argparse.Namespace, impl: str, corpus: data.Corpus, device: torch.device) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[args.model]
    model, step_fn, opt = build(args, impl, cfg, device)
    loader = data.Loader(corpus.train, args.batch, rank, world, seed=args.seed)
    val = data.val_batches(corpus.val, args.batch, args.val_batches, rank, world)
    step = 0
    ckpt_dir = args.checkpoint_dir and (os.path.join(args.checkpoint_dir, impl) if args.compare
                                        else args.checkpoint_dir)
    if args.resume:
        saved = checkpoint.load(ckpt_dir, model, opt)
        step = saved["step"]
        loader.load_state_dict(saved["loader"])
    elif ckpt_dir and args.checkpoint_every:
        checkpoint.check_fresh(ckpt_dir)
    log = metrics.Metrics(os.path.join(args.out, f"metrics-{impl}.jsonl"), rank == 0, resume=args.resume)
    n_params = sum(p.numel() for p in model.parameters())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    tokens_per_step = args.batch * cfg.seq * args.micro_batches * world
    peak = metrics.peak_flops(device)
    log.log({"event": "start", "impl": impl, "world": world, "device": str(device),
             "params_M": round(n_params / 1e6, 2), "params_per_rank_M": round(local / 1e6, 2),
             "compile": args.compile, "data": corpus.describe(),
             "resumed_at": step if args.resume else None})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) \
        if impl == "single" and args.precision == "bf16" else nullcontext()
    if not args.resume:
        log.log({"event": "eval", "step": 0, "val_loss": evaluate(model, val, device, autocast)})
    window: list[float] = []
    reports: list = []
    saved = False
    start = time.perf_counter()
    while step < args.steps:
        step += 1
        if step == args.stall_at_step:
            time.sleep(3600)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i in range(args.micro_batches):
            if impl != "single":
                model.set_requires_gradient_sync(i == args.micro_batches - 1)
            x, y = (t.to(device) for t in loader.next_batch())
            with autocast:
                logits = step_fn(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.micro_batches
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        window.append(time.perf_counter() - t0)
        last = step == args.steps
        if not saved or last:
            saved = save_traces()
        record: dict[str, Any] = {"event": "step", "step": step, "loss": total.item() / world}
        if last and impl == "ours":  # before evaluation runs the eager module
            reports = compiled_fsdp.explain(model)
        if step % args.eval_every == 0 or last:
            record["val_loss"] = evaluate(model, val, device, autocast)
        if step % args.log_every == 0 or last or "val_loss" in record:
            mem = torch.tensor(metrics.peak_memory_mb(device), device=device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            step_s = sum(window) / len(window)
            record.update(lr=lr_at(args, step), step_s=step_s, tokens_per_s=tokens_per_step / step_s,
                          peak_mem_mb=mem.item(), elapsed_s=time.perf_counter() - start,
                          mfu=None if peak is None else metrics.flops_per_token(
                              n_params, cfg.n_layers, cfg.dim, cfg.seq) * tokens_per_step / step_s / world / peak)
            window = []
            log.log(record)
        if ckpt_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            checkpoint.save(ckpt_dir, step, model, opt, {"loader": loader.state_dict(), "model": args.model,
                                                         "impl": impl, "seed": args.seed})
    log.log({"event": "end", "impl": impl, "steps": step, "minutes": round((time.perf_counter() - start) / 60, 2),
             "digest": digest(model)})
    if rank == 0 and reports:
        print("how each fully sharded module ran in the last step (compiled_fsdp.explain):")
        for report in reports:
            print(f"  {report}")
    records = metrics.read(log.path) if rank == 0 else []
    del model, step_fn, opt  # free the process groups now (tools/launch.py: [Note: Process groups at exit])
    gc.collect()
    return records


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank = dist.get_rank()
    try:
        corpus = data.load_corpus(args.data, MODELS[args.model].seq)
        runs = [(impl, train(args, impl, corpus, device)) for impl in (["ours", "fsdp2"] if args.compare
                                                                     else [args.impl])]
    except ValueError as exc:  # bad input: the same verdict on every rank (see checkpoint.py)
        os.write(2, f"train.py: rank {rank}: {exc}\n".encode())  # one write: ranks share the stream
        # Wait until every rank has said it: torchrun stops the others as soon as one exits.
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            dist.barrier()
        sys.exit(2)
    if rank == 0:
        png = os.path.join(args.out, "compare.png" if args.compare else f"train-{args.impl}.png")
        why_not = metrics.plot(runs, png)
        print(why_not or f"wrote {png} and {args.out}/metrics-*.jsonl")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
