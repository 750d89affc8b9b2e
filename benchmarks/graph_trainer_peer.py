"""torchtitan's graph_trainer as a benchmark peer: SimpleFSDP and its whole
training step traced into one FX graph, as torchtitan 0.3.0's
``experiments/graph_trainer`` trains a llama3 model by default
(``compile.mode="aot_fx_trace"``, ``memory_policy="default"``,
``inductor_compilation="regional"``), with what a CPU cannot run left out.

What graph_trainer does (``llama3/parallelize.py``, ``trainer.py``,
``passes.py``), and what this module does the same:

- every submodule's forward annotated with its FQN (``annotate_module_fqns``);
- ``data_parallel(model, mesh, mode="fully_shard")``: each parameter a
  ``Shard(0)`` DTensor gathered when read, the gradient reduce-scattered;
  ``MixedPrecisionPolicy`` as the other kinds' (bf16 compute, fp32 reduce on
  a GPU);
- at the first step, forward + loss + ``autograd.grad`` traced with
  ``make_fx`` (``minimal_fx_tracer``) and rewritten by its default compile-time
  passes: dead code and canonical form, one gather per parameter, the memory
  policy's tags (gathers recomputed in backward: reshard after forward), the
  activation rematerialisation, the transformer-block bucketing and reordering
  (one bucket per block, the embedding, ``[norm, output]``), then the regional
  Inductor pass (no region here: no FlexAttention); every step replays that
  graph (``run_traced``) and adds its gradients to the parameters'.

Left out, each CUDA-only or off by default: the CUDA-graph pass, the collective
process-group reassignment (NCCL streams), EP and async-TP passes, CPU offload
(its pass runs and tags nothing). Only torch releases torchtitan supports
(2.15 here): ``available()`` says whether it imports.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn as nn


def available() -> bool:
    try:
        import torchtitan.experiments.graph_trainer.simple_fsdp  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: not this torch, or not installed
        return False
    return True


def _buckets(model: nn.Module) -> list[Any]:
    """graph_trainer's default plan (``get_default_transformer_block_buckets``)
    with this model's names: the embedding, each block, ``[norm, output]``."""
    return ["tok_embeddings", *(f"layers.{i}" for i in range(len(model.layers))), ["norm", "output"]]


def build(model: nn.Module, device: torch.device, param_dtype: torch.dtype | None,
          reduce_dtype: torch.dtype | None, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          ) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """SimpleFSDP applied to ``model`` (initialised, the same on every rank)
    over the default group; returns the model and ``step(tokens)``, which runs
    forward and backward and leaves the gradients on the parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer.common_utils import (
        accumulate_param_grads_,
        annotate_module_fqns,
        compute_annotated_loss,
    )
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    annotate_module_fqns(model)
    model = data_parallel(model, mesh, mode="fully_shard",
                          mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    params = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]

    def fwd_bwd(tokens: torch.Tensor) -> list[torch.Tensor]:
        loss = compute_annotated_loss(loss_fn, model(tokens), tokens)
        # (read here: the tracer puts fake parameters in place while tracing)
        ps = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
        return [loss, *torch.autograd.grad(loss, ps)]

    traced: list[Any] = []

    def step(tokens: torch.Tensor) -> torch.Tensor:
        from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer, run_traced
        from torchtitan.experiments.graph_trainer.passes import apply_graph_passes

        if not traced:
            t = minimal_fx_tracer(fwd_bwd, module=model)(tokens)
            t.gm = apply_graph_passes(t.gm, t.example_inputs, _passes(model, t))
            traced.append(t)
        out = run_traced(traced[0], module=model)(tokens)
        accumulate_param_grads_(params, out[1:])
        return out[0]

    return model, step


def _passes(model: nn.Module, traced: Any) -> list[Callable]:
    """graph_trainer's ``compile_time_passes`` and its regional Inductor pass,
    for a dense model on one data-parallel dim, reshard after forward."""
    from torchtitan.experiments.graph_trainer.cpu_offload import apply_cpu_offload_pass
    from torchtitan.experiments.graph_trainer.fsdp_passes import (
        deduplicate_fsdp_unshard_chains_pass,
        get_fsdp_param_module_order,
        joint_transformer_block_bucketing_reordering_pass,
    )
    from torchtitan.experiments.graph_trainer.inductor_passes import regional_inductor_pass
    from torchtitan.experiments.graph_trainer.memory_policy import tag_with_memory_policy_pass
    from torchtitan.experiments.graph_trainer.remove_noop_passes import (
        canonicalize_graph_pass,
        eliminate_dead_code_pass,
    )
    from torchtitan.experiments.graph_trainer.selective_activation_remat import selective_activation_remat_pass

    # The fields of GraphTrainer.Config those passes read, at their defaults.
    config = SimpleNamespace(
        compile=SimpleNamespace(memory_policy="default", cpu_offload_budget_gb=None),
        parallelism=SimpleNamespace(fsdp_reshard_after_forward="default", pipeline_parallel_degree=1),
    )
    return [
        eliminate_dead_code_pass,
        canonicalize_graph_pass,
        deduplicate_fsdp_unshard_chains_pass,
        functools.partial(tag_with_memory_policy_pass, config=config),
        functools.partial(apply_cpu_offload_pass, prefetch_lookahead=1, defer_n_layers=1),
        selective_activation_remat_pass,
        functools.partial(joint_transformer_block_bucketing_reordering_pass, module_bucket_plans=_buckets(model),
                          fsdp_param_module_order=get_fsdp_param_module_order(traced.state_fqns)),
        regional_inductor_pass,
    ]
