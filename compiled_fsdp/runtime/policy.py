"""Frozen policies ``fully_shard`` takes, with FSDP2's names and meaning.

[Note: Mixed precision]
With ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` each shard is cast to
``param_dtype`` *before* its all-gather, so the collective moves half the bytes
of an fp32 one, and the module computes with the gathered low-precision copy.
Gradients are cast to ``reduce_dtype``, reduce-scattered in it, and the
averaged shard is cast back to the parameter's own dtype for ``.grad``.
Without ``reduce_dtype`` they are reduced in the parameter's own dtype (torch
2.15's FSDP2; ``param_dtype`` on earlier releases, whose FSDP2 did that).

On torch 2.15 the eager runtime also takes each gradient *as autograd
produced it* where the reduce dtype is wider than the compute dtype, as FSDP2
2.15 does with ``Tensor.grad_dtype`` on its unsharded parameters during a
backward (``ctx.set_output_grad_dtype`` on ``UnshardFn``,
``FSDPParam.unsharded_grad_dtype``): an op that promoted the bf16 weight
(``x.float() * w`` in CPU RMSNorm) hands over an fp32 gradient that is not
rounded to bf16 first, and a weight read twice adds its two bf16 gradients in
bf16, as FSDP2's leaf does (FSDP2 still casts each to fp32 where its
pre-backward has not run yet: a list group's module called after the root's
forward, as a head in a chunked loss). Earlier releases round it, as
their FSDP2 did. A compiled graph rounds it on every release, as FSDP2's
compiled blocks do: AOTAutograd gives a graph input's gradient the input's
dtype. Tested by tests/test_mixed_precision.py::test_grads_in_reduce_dtype. The registered parameters, their
``.grad`` and the optimizer state stay in the original dtype.

The casts are steps of the bucket layout ([Note: Bucket layout] in core/layout.py),
so the eager runtime and the lowering emit the same ones in the same order: in
a compiled graph the cast is the first node of a module's gather chain, and
with ``reshard_after_forward`` it is recomputed in backward with the gather (the
forward saves the fp32 shard, never a bf16 unsharded copy). A bucket carries one
dtype: modules with different policies never share a bucket.

``cast_forward_inputs`` casts the floating-point tensors among a fully sharded
module's forward arguments to ``param_dtype`` in its pre-forward hook;
``output_dtype`` casts its floating-point outputs in its post-forward hook. Under
compile the hooks of modules inside the graph are traced into it; the root's
run as Python around the compiled forward ([Note: Hooks under Dynamo] in
state.py), so the root's casts run eagerly.
Tested by tests/test_mixed_precision.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from compiled_fsdp.core import compat


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy; see [Note: Mixed precision].

    ``param_dtype``: the dtype of the gathered parameters (and of forward and
    backward compute); None keeps the parameters' own dtype.
    ``reduce_dtype``: the dtype gradients are reduced in; None means the
    parameter's own dtype on torch 2.15, ``param_dtype`` before (as FSDP2).
    ``output_dtype``: cast the module's floating-point outputs to it; None leaves them.
    ``cast_forward_inputs``: cast the module's floating-point inputs to ``param_dtype``.
    ``param_dtype_override_fn``: per parameter, None or ``param_dtype`` (the
    default) or the parameter's own dtype (kept, e.g. fp32 norms), as in torch
    2.15's FSDP2; called once per parameter at ``fully_shard``. One group is
    gathered in one dtype here: a module whose parameters would then differ is
    refused with a message (shard the kept ones' module separately).
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Optional[Callable[[nn.Parameter], Optional[torch.dtype]]] = field(
        default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy: {name} must be a floating-point torch.dtype (e.g. "
                    f"torch.bfloat16) or None, got {value!r}."
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"MixedPrecisionPolicy: cast_forward_inputs must be True or False, got "
                f"{self.cast_forward_inputs!r}."
            )

    def for_param(self, param: nn.Parameter) -> "MixedPrecisionPolicy":
        """The policy for ``param``: ``param_dtype_override_fn`` resolved."""
        if self.param_dtype_override_fn is None:
            return self
        dtype = self.param_dtype_override_fn(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None but got {type(dtype)}")
        if dtype is not None and dtype not in (self.param_dtype, param.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return None, param_dtype, or the parameter's original dtype "
                f"but got {dtype} for a parameter with dtype {param.dtype} and param_dtype {self.param_dtype}")
        return replace(self, param_dtype=dtype or self.param_dtype, param_dtype_override_fn=None)

    def agreed(self) -> str:
        """What every rank must agree on (the override function is compared
        through what it returns, per parameter, not by identity)."""
        return repr(replace(self, param_dtype_override_fn=None))

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype a parameter of dtype ``orig`` is gathered and used in (a
        parameter that is not floating point is never cast)."""
        return (self.param_dtype or orig) if orig.is_floating_point else orig

    def grad_reduce_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype its gradient is taken, reduced and kept without sync in
        ([Note: Mixed precision]: without ``reduce_dtype``, torch 2.15's FSDP2
        uses the parameter's own dtype, earlier ones ``param_dtype``)."""
        if not orig.is_floating_point:
            return orig
        default = orig if compat.grads_in_reduce_dtype() else (self.param_dtype or orig)
        return self.reduce_dtype or default


def check_policy(policy: object) -> MixedPrecisionPolicy:
    """``policy`` itself (torch's FSDP2 class taken as ours), or a TypeError
    that says what ``mp_policy`` takes."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, compat.torch_policy_classes()[0]):
        fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
        return MixedPrecisionPolicy(**fields)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard: mp_policy must be a compiled_fsdp.MixedPrecisionPolicy, got "
            f"{type(policy).__name__}. Write mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )
    return policy


def cast_floating(dtype: Optional[torch.dtype], tree: Any) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (no-op for None)."""
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


@dataclass(frozen=True)
class OffloadPolicy:
    """FSDP2's base offload policy: no offloading (the default)."""


# [Note: CPU offload]
# FSDP2's ``CPUOffloadPolicy``: the shard (the registered DTensor's local
# tensor) lives on the CPU, pinned where an accelerator exists and
# ``pin_memory`` asks, while the mesh is the compute device's (a model on
# the CPU under NCCL is taken: its mesh is CUDA's). Each gather copies the
# shard to the compute device first (on the gather stream, non-blocking
# from pinned memory; a shard materialized after ``fully_shard`` is pinned
# at the first forward) and gathers there; each reduced gradient shard is copied
# back (``FSDPParam.add_grad``; the eager runtime's without blocking: [Note:
# Offloaded gradients land at the end of backward] in reduces.py), so ``.grad`` and the optimizer's state
# are on the CPU and the optimizer steps there. The unsharded buffers, the gradient sink
# and kept gradients are on the compute device. A shard left on another
# device (``to_empty(device="cuda")`` after a meta init) is refused at the
# first forward with FSDP2's error. In a whole-model graph the copies are
# the graph's, scheduled with the gathers ([Note: CPU offload in graphs] in
# passes/lowering.py); a block compiled on its own is gathered by the eager
# runtime ([Note: Extension groups run the eager runtime] in
# compile/path.py). On a machine without an accelerator the compute device
# is the CPU and the copies are none. Tested by tests/test_offload.py.


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's CPU offload policy: sharded parameters, their gradients and the
    optimizer step live on the CPU (pinned with ``pin_memory`` where an
    accelerator exists); each shard is copied to the compute device for its
    all-gather, each reduced gradient shard back. See [Note: CPU offload]."""

    pin_memory: bool = True


def check_offload(policy: object) -> Optional[CPUOffloadPolicy]:
    """``offload_policy`` as FSDP2 takes it (torch's classes taken as ours):
    the CPU offload policy, or None for none; a TypeError for anything else."""
    _, torch_offload, torch_cpu_offload = compat.torch_policy_classes()
    if isinstance(policy, torch_cpu_offload):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if policy is None or isinstance(policy, torch_offload) or type(policy) is OffloadPolicy:
        return None
    if not isinstance(policy, CPUOffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got "
                        f"{type(policy).__name__}.")
    return policy


@dataclass(frozen=True)
class DataParallelMeshDims:
    """torch 2.15's ``DataParallelMeshDims``: which dims of the full SPMD mesh
    passed as ``fully_shard(mesh=...)`` are data parallel (a name, or a tuple
    of names flattened into one dim). ``fully_shard`` takes torch's class too,
    on every release. See [Note: dp_mesh_dims] in validation.py."""

    shard: Optional[Union[str, tuple[str, ...]]] = None
    replicate: Optional[Union[str, tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")
