"""Full (unsharded) state dicts: gather one for saving, load one back into shards.

``module.state_dict()`` on a sharded model returns each rank's shards under the
original FQNs; these functions convert to and from the full tensors a
single-process model would have. Every rank must call them (they communicate),
and they communicate group by group in ``module.modules()`` order, the same on
every rank.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from ._collectives import all_gather_bucket, copy_out_all_gather
from ._state import iter_fsdp_states


def _unwrap(model: nn.Module) -> nn.Module:
    # torch.compile's OptimizedModule prefixes keys with "_orig_mod."; users want the plain FQNs.
    return getattr(model, "_orig_mod", model)


def get_full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every managed parameter gathered to its full shape."""
    model = _unwrap(model)
    full: dict[str, torch.Tensor] = {}
    for state in iter_fsdp_states(model):
        group = state.param_group
        if group is None:
            continue
        flat = all_gather_bucket([p.sharded for p in group.fsdp_params], group.process_group, async_op=False).wait()
        dests = [torch.empty(p.spec.full_shape, dtype=p.sharded.dtype, device=p.sharded.device) for p in group.fsdp_params]
        copy_out_all_gather(flat, group.specs, dests)
        for p, t in zip(group.fsdp_params, dests):
            full[id(p.sharded)] = t
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        tensor = full.get(id(value), value)
        tensor = tensor.detach()
        out[key] = tensor.cpu() if cpu_offload else tensor.clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a full (unsharded) state dict: each rank keeps its own shard of each parameter."""
    model = _unwrap(model)
    shard_of = {}
    for state in iter_fsdp_states(model):
        if state.param_group is not None:
            group = state.param_group
            for p in group.fsdp_params:
                shard_of[id(p.sharded)] = (p, group.process_group.rank())
    local: dict[str, Any] = {}
    current = model.state_dict(keep_vars=True)
    for key, value in state_dict.items():
        target = current.get(key)
        managed = shard_of.get(id(target)) if target is not None else None
        if managed is None:
            local[key] = value
            continue
        fp, rank = managed
        if tuple(value.shape) != fp.spec.full_shape:
            raise ValueError(
                f"load_full_state_dict: {key!r} has shape {tuple(value.shape)}, expected the full shape "
                f"{fp.spec.full_shape}; pass a full state dict (get_full_state_dict), not a sharded one."
            )
        local[key] = fp.spec.shard(value.to(device=fp.sharded.device, dtype=fp.sharded.dtype), rank)
    model.load_state_dict(local, strict=strict)
