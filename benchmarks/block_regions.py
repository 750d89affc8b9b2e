"""A prototype of issue 47's design, measured: ``torch.compile(model)`` with
each block a ``torch.compiler.nested_compile_region``, traced and compiled
once, every block calling the one subgraph (RESULTS, "Blocks as compile
regions: a prototype").

    python benchmarks/block_regions.py [--backend aot_eager|inductor] [--layers 8] [--mode MODE]

Modes (2 gloo ranks, the benchmark GPT at d=64, ``fully_shard`` per block and
root, ``torch.compile(model, fullgraph=True)``, caches off):

  today          the project as it is: one graph holding every block
  regions        every block a region (the prototype below)
  plain          the unsharded model compiled whole (no sharding)
  plain_regions  the unsharded model, every block a region

Printed (rank 0, JSON): the first step and the next two, |loss - reference|
per step and the largest gradient difference of step 0 against a
single-process reference, Dynamo's phases, and the subgraphs Dynamo made.

This is a prototype, not the package: it changes the project's read path in
its own process only. What ``regions`` changes, and why each is needed
(found by trying; DESIGN.md, "Blocks compiled on their own"):

1. A region's parameter reads emit markers keyed ``ENTRY_KEY`` with no
   per-block ``comptime`` record: Dynamo reuses a region's trace only where
   its guards hold for the next block, and a marker keyed by its group failed
   ``CONSTANT_MATCH`` on ``group.key``; with one subgraph per block, Dynamo
   inlines each (``inline_single_use_invoke_subgraph``) and the result is
   today's one graph.
2. The marker reads a plain leaf aliasing the local shard
   (``to_local().detach().requires_grad_()``), whose gradient is moved into
   the DTensor's ``.grad`` after backward: AOTAutograd flattens the DTensor
   inputs of ``invoke_subgraph`` but the subgraph still calls ``to_local()``
   (``AttributeError: 'FakeTensor' object has no attribute 'to_local'``, 2.13
   and 2.15), and reading ``_local_tensor`` instead cuts the gradient.
3. The region's joint graph is lowered by its own partitioner
   (``NestedCompileRegionOptions(partitioner=...)``: ``run_joint_passes``,
   then the min-cut partitioner): ``joint_custom_pass`` sees only the outer
   graph. Options need ``torch._dynamo.config
   .enable_invoke_subgraph_regional_compile`` ("for testing only").

Not done here: gathers handed across regions (each block gathers and waits
at its start), the eager fallback inside a region, no-sync, HSDP, mixed
precision, and a stale alias after the local shard is replaced.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")]

from _dist import run_distributed  # noqa: E402

MODES = ("today", "regions", "plain", "plain_regions")


def _region_read(self: Any, param: Any) -> torch.Tensor:
    """The read path inside a region (see the module docstring, 1 and 2)."""
    from compiled_fsdp.compile.path import TorchCompilePath
    from compiled_fsdp.core.marker import ENTRY_KEY, Unshard

    group = param.group
    if getattr(param, "region_shard", None) is None:  # (the root's parameters)
        return TorchCompilePath._project_read(self, param)
    assert param.shard_dim == 0, "the prototype reads Shard(0) parameters"
    sync = group.reduce_grads or not param.sharded.requires_grad
    full = Unshard.call(
        shard=param.region_shard, full_shape=list(param.spec.full_shape), group_name=group.group_name,
        world_size=param.spec.world_size, module_key=ENTRY_KEY, param_index=param.index,
        local_rows=param.local_rows, reshard_after_forward=group.reshard_after_forward,
        reduce_group_name=group.reduce_group_name, param_dtype=param.param_dtype,
        reduce_dtype=param.reduce_dtype, kept=param.kept_grad() if sync else param.grad_sink, sync=sync,
        outermost=group.outermost, gathered=None, bucket_offset=0, bucket_numel=0,
        reduce_by_all_to_all=group.reduce_by_all_to_all, replicate_group_name=group.replicate_group_name,
        replicas=param.spec.replicas, divide_factor=param.spec.divide_factor)
    return full


def _partitioner(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """The region's joint graph: our passes, then the min-cut partitioner (3)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from compiled_fsdp.passes import run_joint_passes

    run_joint_passes(joint)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _rank(rank: int, world: int, backend: str, layers: int, mode: str) -> dict:
    from torch._higher_order_ops.invoke_subgraph import NestedCompileRegionOptions
    from torch.distributed.tensor import DTensor

    import compiled_fsdp
    from compiled_fsdp.compile.path import TorchCompilePath
    from compiled_fsdp.tools.models import GPT, Block, GPTConfig, batch, loss_fn

    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    sharded, regions = not mode.startswith("plain"), mode.endswith("regions")
    if regions:
        forward = Block.forward
        options = None
        if sharded:
            torch._dynamo.config.enable_invoke_subgraph_regional_compile = True
            options = NestedCompileRegionOptions(partitioner=_partitioner)
            TorchCompilePath._project_read = TorchCompilePath.traced_read
            TorchCompilePath.traced_read = _region_read
        region = torch.compiler.nested_compile_region(lambda self, x: forward(self, x), options=options)
        Block.forward = lambda self, x: region(self, x)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=layers, dim=64, vocab=512, seq=64, n_heads=4)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    aliased = []
    if sharded:
        for block in model.layers:
            compiled_fsdp.fully_shard(block)
        compiled_fsdp.fully_shard(model)
        if regions:
            for block in model.layers:
                for m in block.modules():
                    for p in getattr(m, "_fsdp_params", {}).values():
                        p.region_shard = p.sharded.to_local().detach().requires_grad_()
                        aliased.append(p)
    subgraphs: list[str] = []

    def backend_fn(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        subgraphs[:] = [name for name, _ in gm.named_children() if name.startswith("subgraph")]
        return lookup_backend(backend)(gm, inputs)

    run = torch.compile(model, backend=backend_fn, fullgraph=True)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    out: dict[str, Any] = {"mode": mode, "backend": backend, "layers": layers, "steps_s": [], "loss_diff": []}
    for step in range(3):
        tokens = batch(cfg, 4, seed=step)
        t0 = time.perf_counter()
        loss = loss_fn(run(tokens), tokens)
        loss.backward()
        for p in aliased:  # (2) the alias's gradient into the DTensor's
            g, p.region_shard.grad = p.region_shard.grad, None
            d = DTensor.from_local(g, p.sharded.device_mesh, p.sharded.placements, shape=p.sharded.shape,
                                   stride=p.sharded.stride())
            p.sharded.grad = d if p.sharded.grad is None else p.sharded.grad + d
        out["steps_s"].append(time.perf_counter() - t0)
        ref_loss = loss_fn(ref(tokens), tokens)
        ref_loss.backward()
        out["loss_diff"].append(abs(loss.item() - ref_loss.item()))
        if step == 0:
            grads = dict(ref.named_parameters())
            out["grad_diff"] = max(
                ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n].grad).abs().max().item()
                for n, p in model.named_parameters())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    times = torch._dynamo.utils.compilation_time_metrics
    out["phases_s"] = {k: round(sum(times.get(k, [])), 2) for k in
                       ("bytecode_tracing", "aot_trace_joint_graph", "compile_fx_inner")}
    out["subgraphs"] = len(subgraphs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="inductor", choices=("aot_eager", "inductor"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mode", default="regions", choices=MODES)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args.backend, args.layers, args.mode, timeout=3600)[0]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
