"""Train a GPT with compiled_fsdp under torchrun: the README's main job.

    torchrun --nproc-per-node 2 examples/train.py            # Inductor
    torchrun --nproc-per-node 2 examples/train.py --compile none   # eager hook runtime
    torchrun --nproc-per-node 2 examples/train.py --compile-blocks # each block compiled on its own
    torchrun --nproc-per-node 4 examples/train.py --hsdp 2         # HSDP: 2 replicas x 2 shards

Uses CUDA + NCCL when a GPU is available, CPU + gloo otherwise. Each rank gets its
own batches (data parallel); rank 0 prints the loss and what each rank holds.
Parameters are gathered and used in bf16 and gradients reduced in fp32
(``MixedPrecisionPolicy``; ``--precision fp32`` turns it off), and each optimizer
step accumulates ``--micro-batches`` backward passes, reduce-scattering only on
the last (``set_requires_gradient_sync``).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from compiled_fsdp import MixedPrecisionPolicy, explain, fully_shard  # noqa: E402
from examples import gpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=["tiny", "small", "bench"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compile", default="inductor", choices=["inductor", "aot_eager", "none"])
    parser.add_argument("--compile-blocks", action="store_true",
                        help="compile each block on its own (block.compile()), the root eager: one graph "
                             "shared by the blocks, compile time independent of depth (README)")
    parser.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                        help="bf16: gather and compute in bf16, reduce in fp32 (default)")
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="backward passes per optimizer step (gradient sync on the last only)")
    parser.add_argument("--checkpoint", default=None, help="DCP checkpoint folder (default: a temporary one)")
    parser.add_argument("--hsdp", type=int, default=0, metavar="R",
                        help="HSDP: R replicas, each sharded over world/R ranks (a 2-D mesh; default: 1-D)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")

    if args.model == "tiny":
        model = gpt.tiny()
    elif args.model == "bench":
        model = gpt.bench()
    else:
        torch.manual_seed(0)
        model = gpt.GPT(gpt.GPTConfig(vocab=512, dim=128, n_layers=4, n_heads=4, seq=64))
    cfg = model.cfg
    model.to(device)
    total = sum(p.numel() for p in model.parameters())
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.precision == "bf16" else None
    mesh = None
    if args.hsdp:
        if args.hsdp < 1 or world % args.hsdp:
            parser.error(f"--hsdp {args.hsdp}: the world size {world} must be a multiple of R")
        mesh = init_device_mesh(device.type, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=not args.no_reshard, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=not args.no_reshard, mp_policy=mp_policy)
    local = sum(p.to_local().numel() for p in model.parameters())
    # fused: one kernel per step instead of one DTensor dispatch per tensor and op (DESIGN.md)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    backend = "inductor" if args.compile == "inductor" else "aot_eager"
    if args.compile == "none":
        step_fn = model
    elif args.compile_blocks:  # torchtitan's pattern: the blocks' graphs hand gathers along
        for block in model.layers:
            block.compile(backend=backend)
        step_fn = model
    else:
        step_fn = torch.compile(model, backend=backend)

    if rank == 0:
        print(f"{world} ranks on {device}, {total / 1e6:.2f}M parameters, {local / 1e6:.2f}M on each rank, "
              f"compile={args.compile}{' (each block)' if args.compile_blocks else ''}, "
              f"precision={args.precision}, micro-batches={args.micro_batches}")
    micro = args.micro_batches
    for step in range(args.steps):
        start = time.perf_counter()
        loss = torch.zeros((), device=device)
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)  # reduce-scatter on the last only
            tokens = gpt.batch(cfg, args.batch, seed=1000 * step + 100 * i + rank).to(device)
            micro_loss = gpt.loss_fn(step_fn(tokens), tokens).float() / micro
            micro_loss.backward()
            loss += micro_loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item() / world:.4f}  {time.perf_counter() - start:.2f}s")
    if rank == 0:
        print("how each fully sharded module ran (compiled_fsdp.explain):")
        for report in explain(model):
            print(f"  {report}")
    # Checkpoint with the standard APIs (parameters are DTensors): save model and
    # optimizer with DCP, reload them into the same objects, check nothing moved.
    ckpt = args.checkpoint or os.path.join(tempfile.gettempdir(), f"compiled_fsdp_ckpt_{os.getppid()}")
    model_sd, optim_sd = get_state_dict(step_fn, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model_sd, optim_sd = get_state_dict(step_fn, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(step_fn, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
    if rank == 0:
        print(f"DCP checkpoint saved to {ckpt} and reloaded: {'bitwise equal' if same else 'MISMATCH'}")
    if not same:
        raise SystemExit("the reloaded checkpoint differs from the saved parameters")
    dist.destroy_process_group()
    # Free the model's process groups now, not at interpreter exit (see
    # [Note: Process groups at exit] in compiled_fsdp/tools/launch.py).
    del model, step_fn, opt, model_sd, optim_sd, state
    gc.collect()


if __name__ == "__main__":
    main()
