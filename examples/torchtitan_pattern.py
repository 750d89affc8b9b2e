"""torchtitan's training pattern in three functions, for any decoder whose
forward can stop before its output head (torchtitan 0.3.0's
``parallelize_llama`` and ``ChunkedLossWrapper``, written for this project's
tests and benchmarks; works with torch's FSDP2 and with compiled_fsdp):

- ``selective_ac(block)``: op-level selective activation checkpointing
  (matmul outputs saved, the rest recomputed), applied before compile;
- ``shard_like_torchtitan(fully_shard, ...)``: the embedding, ``[norm, head]``
  as one group kept gathered after forward, each block, then the root;
  gradients summed (divide factor 1.0: torchtitan scales by the token count);
- ``chunked_loss(head, hidden, labels)``: the head runs once per chunk of the
  sequence on a detached leaf, a backward after each, and one backward then
  runs through the body.

Per-block compile is ``block.compile(fullgraph=True)`` after ``selective_ac``
and before ``fully_shard``, with torchtitan's
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["chunked_loss", "selective_ac", "shard_like_torchtitan"]


def selective_ac(block: nn.Module) -> nn.Module:
    """``block`` under torchtitan's op-level selective activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint_wrapper(block, context_fn=lambda: create_selective_checkpoint_contexts(policy),
                              preserve_rng_state=False)


def shard_like_torchtitan(fully_shard: Callable[..., object], root: nn.Module, embed: nn.Module,
                          blocks: Sequence[nn.Module], norm: nn.Module, head: nn.Module, **kwargs: object) -> None:
    """``apply_fsdp_to_decoder`` with its defaults (``fully_shard`` is torch's or ours)."""
    fully_shard(embed, **kwargs)
    fully_shard([norm, head], reshard_after_forward=False, **kwargs)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(root, **kwargs)
    for m in root.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)


class _BodyGrad(torch.autograd.Function):
    """torchtitan's ``_DecoderOutputGradientBackProp``: the loss, whose
    backward hands the chunks' gradient to the body."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple:  # noqa: ANN001
        return ctx.saved_tensors[0], None, None


def chunked_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunks: int = 4) -> torch.Tensor:
    """Cross entropy (summed, over the token count, in fp32) of ``head(hidden)``
    against ``labels``, ``chunks`` chunks along the sequence, each backward
    run at once; ``.backward()`` on the result runs the body's."""
    sharded = hasattr(head, "set_requires_gradient_sync")
    pieces = [c.detach().requires_grad_(True) for c in hidden.chunk(chunks, dim=1)]
    if sharded:  # keep the head gathered across the chunks, reduce its gradient once
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    total, grads = torch.zeros((), device=hidden.device), []
    for i, (h, y) in enumerate(zip(pieces, labels.chunk(chunks, dim=1))):
        if sharded and i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(h).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / labels.numel()
        total = total + loss.detach()
        loss.backward()
        grads.append(h.grad)
    if sharded:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    return _BodyGrad.apply(hidden, torch.cat(grads, dim=1), total)
