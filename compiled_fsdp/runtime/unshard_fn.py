"""The eager runtime's autograd function for a reduce bucket's gathered
parameters, and the views it hands to module code.

[Note: Eager autograd through UnshardFn]
In eager mode a group's unsharded parameters are the outputs of an autograd
function, ``UnshardFn``, one per reduce bucket
(one bucket, the whole group, but for [Note: replicate's buckets] in
replicate.py). Autograd runs its backward exactly once per backward pass, after
every use of every parameter of the bucket has produced its gradient (a module
called twice included: autograd sums the uses). That moment is the bucket's
post-backward: it issues one bucketed reduction and returns no gradient to
autograd; the reduced gradients are written to ``shard.grad`` when the reduction
is awaited (at the latest in the root's end-of-backward callback, so every
reduction has finished when ``backward()`` returns); after the group's last
bucket the group reshards. The outputs are views of the unsharded buffers, so
freeing a buffer's storage after forward (reshard) and refilling it before
backward is seen by autograd's saved tensors; the refill preserves the version
counter, as FSDP2 does.

Its one input is a leaf of no elements that requires grad (the group's
anchor, when any parameter of the bucket does), not the shards: with the
shards as inputs, autograd's AccumulateGrad ran on each sharded parameter
with no gradient and, with it, the parameter's post-accumulate-grad hooks,
before the reduced gradient arrived (an optimizer in backward stepped on
nothing; the hooks belong after ``add_grad``, as FSDP2 runs them:
tests/test_fsdp2_215.py::test_optimizer_in_backward). As in FSDP2,
``loss.backward(inputs=sharded_params)`` therefore reaches no reduction, and
a tensor hook (``register_hook``) on a sharded parameter sees no gradient.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol, Sequence

import torch

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.param import FSDPParam

__all__ = ["BucketOwner", "UnshardFn", "static_view"]


class BucketOwner(Protocol):
    """What ``UnshardFn`` asks of its parameter group (``FSDPParamGroup``)."""

    fsdp_params: list[FSDPParam]
    reduce_buckets: Sequence[Sequence[int]]

    def post_backward(self, grads: tuple[Optional[torch.Tensor], ...], bucket: int = 0) -> None:
        """Every gradient of reduce bucket ``bucket`` exists: reduce them."""


class UnshardFn(torch.autograd.Function):
    """See [Note: Eager autograd through UnshardFn]: one per reduce bucket."""

    @staticmethod
    def forward(ctx: Any, group: BucketOwner, bucket: int, anchor: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # Weakly: the outputs' autograd node holds ctx from C++, where Python's
        # collector cannot see it, and a parameter keeps its unsharded view (an
        # output) alive: a strong group here made a cycle that kept every model
        # alive for good (tests/test_state.py).
        ctx.group, ctx.bucket = weakref.ref(group), bucket
        ctx.set_materialize_grads(False)
        params = [group.fsdp_params[i] for i in group.reduce_buckets[bucket]]
        outs = tuple(p.unsharded.view_as(p.unsharded) for p in params)
        ctx.mark_non_differentiable(*(o for o, p in zip(outs, params) if not p.sharded.requires_grad))
        if compat.grads_in_reduce_dtype():  # see [Note: Mixed precision] in policy.py
            ctx.set_output_grad_dtype(*(p.unsharded_grad_dtype() for p in params))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[None, ...]:
        group = ctx.group()
        if group is not None:  # (None: the model was freed before this backward ran)
            with compat.no_spmd_typecheck():
                group.post_backward(grads, ctx.bucket)
        return None, None, None


def static_view(view: torch.Tensor) -> torch.Tensor:
    """[Note: Gathered views are static to Dynamo]
    A module compiled on its own whose parameters the eager runtime gathered
    (activation checkpointing around it, or the fallback) reads them as plain
    graph inputs, not as ``nn.Parameter``s, so Dynamo's automatic dynamic
    shapes may make their sizes symbolic at a recompile, where FSDP2's
    unsharded ``nn.Parameter``s stay static (``force_parameter_static_shapes``).
    Under TP that symbolic size sent AOTAutograd into unbounded recursion
    (a cycle of symbolic proxies: tests/test_tensor_parallel.py::
    test_blocks_compiled_in_place_under_checkpoint). Marked static, they
    specialize as parameters do."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static(view)
    return view
