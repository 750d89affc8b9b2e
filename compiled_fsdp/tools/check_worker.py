"""The per-rank side of ``python -m compiled_fsdp.check``: train the
single-process reference and each sharded variant on the same batches and
measure, per step, how far each variant is from the reference.

Also home of the comparison helpers the tests share (``tests/_parity.py``).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from compiled_fsdp.runtime.api import fully_shard
from compiled_fsdp.runtime.state import get_fsdp_state, iter_fsdp_states
from compiled_fsdp.tools import models

__all__ = ["CheckConfig", "ModelSpec", "load_model_spec", "local_tensor", "managed_params", "max_diff", "run_rank",
           "shard_specs"]


def managed_params(model: nn.Module) -> dict[int, Any]:
    """id(shard parameter) -> its ``FSDPParam``."""
    return {
        id(fp.sharded): fp
        for st in iter_fsdp_states(getattr(model, "_orig_mod", model))
        if st.param_group is not None
        for fp in st.param_group.fsdp_params
    }


def shard_specs(model: nn.Module) -> dict[int, Any]:
    """id(shard parameter) -> its ShardSpec."""
    return {k: fp.spec for k, fp in managed_params(model).items()}


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part of ``t``: a DTensor's local tensor, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def max_diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    """max |a - b| over this rank's local parts; 0 when both are None, inf when only one is."""
    a, b = local_tensor(a), local_tensor(b)
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How the checker builds, shards, feeds and scores a model. See
    [Note: Model protocol] in ``check.py``."""

    build: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int, int], tuple]
    loss_fn: Callable[..., torch.Tensor]
    shard: Callable[[nn.Module], None]


def _default_batch(model: nn.Module, batch_size: int, seed: int) -> tuple:
    return (models.batch(model.cfg, batch_size, seed),)


def _default_loss(output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    return models.loss_fn(output, *inputs)


def _default_shard(model: nn.Module) -> None:
    for block in getattr(model, "layers", []):
        fully_shard(block)
    fully_shard(model)


def load_model_spec(spec: str) -> ModelSpec:
    """``module:factory`` -> ModelSpec; hooks come from the factory's attributes,
    then from the module, then the GPT defaults."""
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model must be module:factory, got {spec!r}")
    module = importlib.import_module(mod_name)
    factory = getattr(module, attr)

    def hook(name: str, default: Callable) -> Callable:
        return getattr(factory, name, None) or getattr(module, name, None) or default

    return ModelSpec(factory, hook("make_batch", _default_batch), hook("loss_fn", _default_loss),
                     hook("shard", _default_shard))


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    model: str
    variants: tuple[str, ...]
    steps: int
    batch_size: int
    lr: float
    per_rank_data: bool


def _inputs(spec: ModelSpec, model: nn.Module, cfg: CheckConfig, step: int, rank: int, world: int) -> tuple:
    """This rank's inputs and the reference's (every rank's batch, concatenated)."""
    if not cfg.per_rank_data:
        inputs = spec.make_batch(model, cfg.batch_size, 1000 * step)
        return inputs, inputs
    per_rank = [spec.make_batch(model, cfg.batch_size, 1000 * step + r) for r in range(world)]
    ref = tuple(torch.cat(parts) for parts in zip(*per_rank))
    return per_rank[rank], ref


def _reference(spec: ModelSpec, cfg: CheckConfig, rank: int, world: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    out = []
    for step in range(cfg.steps):
        _, inputs = _inputs(spec, model, cfg, step, rank, world)
        loss = spec.loss_fn(model(*inputs), *inputs)
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values() if g is not None))
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"loss": loss.item(), "grad_norm": norm, "grads": grads, "params": params})
    return out


def _wrap(model: nn.Module, variant: str) -> nn.Module:
    if variant == "eager":
        return model
    torch._dynamo.reset()  # no cache entry of another backend may serve this one
    if variant.startswith("blocks"):  # torchtitan's pattern: each sharded module but the root
        backend = "inductor" if variant == "blocks_inductor" else "aot_eager"
        for state in iter_fsdp_states(model):
            if state.module is not model:
                state.module.compile(backend=backend)
        return model
    return torch.compile(model, backend=variant)


def _owner_fqns(model: nn.Module) -> dict[str, str]:
    """parameter FQN -> FQN of the innermost fully sharded module above it."""
    owner: dict[str, str] = {}
    for fqn, module in model.named_modules():  # parents first: children overwrite
        if get_fsdp_state(module) is not None:
            for name, _ in module.named_parameters(prefix=fqn):
                owner[name] = fqn
    return owner


def _run_variant(spec: ModelSpec, cfg: CheckConfig, variant: str, ref: list[dict[str, Any]],
                 rank: int, world: int, baseline: Optional[list[dict[str, Any]]] = None,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per step: the combined measurements, and this rank's local grads and
    params (to compare another variant with this one). ``baseline``: another
    variant's local tensors, compared as ``vs_baseline``."""
    torch.manual_seed(0)
    model = spec.build()
    spec.shard(model)
    managed = managed_params(model)
    owner = _owner_fqns(model)
    runner = _wrap(model, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    named = dict(model.named_parameters())

    def local(name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        fp = managed.get(id(named[name]))
        return t if t is None or fp is None else fp.local_of(t, fp.shard_rank)  # (its rank in the shard group)

    out, tensors = [], []
    for step in range(cfg.steps):
        inputs, _ = _inputs(spec, model, cfg, step, rank, world)
        loss = spec.loss_fn(runner(*inputs), *inputs)
        loss.backward()
        r = ref[step]
        module_grad: dict[str, float] = {}
        sq = 0.0
        for n, p in named.items():
            d = max_diff(p.grad, local(n, r["grads"][n]))
            m = owner.get(n, "")
            module_grad[m] = max(module_grad.get(m, 0.0), d)
            sq += 0.0 if p.grad is None else float(local_tensor(p.grad).double().pow(2).sum())
        mine = {"grads": {n: None if p.grad is None else local_tensor(p.grad).clone() for n, p in named.items()}}
        opt.step()
        opt.zero_grad()
        abs_d = rel_d = 0.0
        for n, p in named.items():
            want = local(n, r["params"][n])
            d = max_diff(p.detach(), want)
            abs_d = max(abs_d, d)
            rel_d = max(rel_d, d / max(want.abs().max().item(), 1e-12) if want.numel() else 0.0)
        mine["params"] = {n: local_tensor(p.detach()).clone() for n, p in named.items()}
        vs = 0.0
        if baseline is not None:
            other = baseline[step]
            vs = max(max(max_diff(mine[k][n], other[k][n]) for n in named) for k in ("grads", "params"))
        out.append(_all_ranks(loss.item(), sq, abs_d, rel_d, vs, module_grad, world))
        tensors.append(mine)
    return out, tensors


def _all_ranks(loss: float, grad_sq: float, abs_d: float, rel_d: float, vs: float,
               module_grad: dict[str, float], world: int) -> dict[str, Any]:
    """Combine the ranks: mean loss, global grad norm, max differences."""
    names = sorted(module_grad)
    vec = torch.tensor([loss, grad_sq], dtype=torch.float64)
    dist.all_reduce(vec)
    mx = torch.tensor([abs_d, rel_d, vs, *(module_grad[n] for n in names)], dtype=torch.float64)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    return {"loss": vec[0].item() / world, "grad_norm": math.sqrt(vec[1].item()),
            "param_abs": mx[0].item(), "param_rel": mx[1].item(), "vs_baseline": mx[2].item(),
            "module_grad": dict(zip(names, mx[3:].tolist()))}


def run_rank(rank: int, world: int, cfg: CheckConfig) -> dict[str, Any]:
    """Everything one rank measures: the reference, then every variant."""
    spec = load_model_spec(cfg.model)
    ref = _reference(spec, cfg, rank, world)
    results: dict[str, Any] = {"reference": [{"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in ref]}
    eager: Optional[list[dict[str, Any]]] = None
    for variant in cfg.variants:  # eager first (check.py orders them): compiled variants compare with it
        results[variant], tensors = _run_variant(spec, cfg, variant, ref, rank, world,
                                                 None if variant == "eager" else eager)
        if variant == "eager":
            eager = tensors
    return results
