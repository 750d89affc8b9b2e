"""Whether a module's backward reads its gathered parameters.

[Note: Embeddings are not gathered for backward]
An embedding's backward never reads its weight: the weight's gradient is the
output's gradient added into the rows that were looked up. Still, FSDP2
gathers every module that resharded after forward again before its backward,
unless the user calls ``set_unshard_in_backward(False)`` (FSDP2 calls it a
switch for experts). torchtitan shards the embedding on its own and runs it
eagerly, so every step moved the embedding's weight once more for nothing, at
the end of backward. There it delayed the last reduce-scatters: 47 ms of a
1.23 s step in ``benchmarks/emulated.py``'s torchtitan pattern (8 ranks, CPU).

The eager runtime decides this after each forward, from the autograd graph
that forward built. A group is a candidate only if it is one module's (not
FSDP2's list form, whose other modules' outputs the walk would not start
from) and its parameters are held by ``nn.Embedding`` modules alone (any
subclass: torchtitan's has its own forward); a module called twice in one
forward gathers if either call may read. Such a group skips its backward gather when every autograd node that
takes one of its parameters, on the paths from the module's outputs, is an
``EmbeddingBackward0``, and no saved-tensor hook packed that node's saved
indices. A hook there would mean an activation checkpoint, whose backward
recomputes the lookup and reads the weight. In every other case the group
gathers, as FSDP2 does: a tied output head, a checkpointed lookup, a graph
too large to walk. ``set_unshard_in_backward`` overrides the decision either
way.

What the walk cannot see is a use of the parameters that reaches none of the
module's outputs. A module with such a use should call
``set_unshard_in_backward(True)``. Every rank builds the same graph, so every
rank decides the same way. Tested by
tests/test_chunked_loss.py::test_embedding_not_gathered_for_backward.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["backward_reads_params", "only_embeddings_hold"]

_WALK_LIMIT = 256  # autograd nodes; past it the group gathers (a lookup's graph has a handful)


def only_embeddings_hold(params: Iterable[nn.Parameter], root: nn.Module) -> bool:
    """Whether the modules under ``root`` that register any of ``params`` are
    all ``nn.Embedding`` (and there is one)."""
    ids = {id(p) for p in params}
    holders = [m for m in root.modules() if any(id(t) in ids for t in m._parameters.values())]
    return bool(holders) and all(isinstance(m, nn.Embedding) for m in holders)


def _lookup_only(node: Any) -> bool:
    """``node`` is an embedding lookup's backward that no activation checkpoint
    will recompute (its saved indices were packed by no hook)."""
    if node.name() != "EmbeddingBackward0":
        return False
    saved = getattr(node, "_raw_saved_indices", None)
    return saved is not None and saved.unpack_hook is None


def backward_reads_params(outputs: Sequence[torch.Tensor], views: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether the backward from ``outputs`` may read ``views`` (the gathered
    parameters the forward computed with). See [Note: Embeddings are not
    gathered for backward]."""
    ours = {v.grad_fn for v in views if v is not None and v.grad_fn is not None}
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in ours:
            continue
        seen.add(node)
        if len(seen) > _WALK_LIMIT:
            return True
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in ours and not _lookup_only(node):
                return True
            stack.append(child)
    return False
