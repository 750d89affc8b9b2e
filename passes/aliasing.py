"""A compile region's graphs return no alias of the activations they take.

[Note: A region returns no alias of its inputs]
The min-cut partitioner saves what a region's backward needs as extra
outputs of its forward, and an input it needs (the block's input, which
its first norm reads again in backward) is saved as that input itself: the
forward graph returns one of its placeholders, or a view of one. torch
clones a region's *outputs* that alias its inputs before it partitions
(``clone_outputs_aliasing_inputs`` in ``invoke_subgraph``), not the saved
values the partitioner adds. Inductor's outer graph then takes the saved
value for a fresh buffer of the region's call: the block's input looks dead
after the call, and Inductor reuses its buffer, in place, for what comes
next (the final norm's output, for the last block), so the region's
backward read the final norm's output as its input. Every gradient below
the last block's second norm was wrong under Inductor (2e-3 against the
reference in the first step; ``aot_eager``, which reuses nothing, was
bitwise). So each output of a region's forward or backward graph that is
an input of that graph, or a view of one, is cloned there, unless that
input is a shard the markers read: the outer graph takes those from its
own inputs, whose buffers Inductor never reuses. A clone costs one copy of
the block's input a step; the input's own buffer is freed instead.
Tested by tests/test_block_regions.py::test_identical_blocks_compile_once
[inductor], against the single-process reference, and by
tests/test_passes_fx.py::test_region_outputs_aliasing_inputs_are_cloned.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph import NodeBuilder

__all__ = ["clone_outputs_aliasing_inputs"]

NAMESPACE = "compiled_fsdp"


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view


def _reads_shard(placeholder: fx.Node) -> bool:
    """Whether one of the markers' ops (lowered or not) takes ``placeholder``."""
    return any(isinstance(u.target, torch._ops.OpOverload) and u.target.namespace == NAMESPACE
               for u in placeholder.users)


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is, or is a chain of views of; else None."""
    while _is_view(node):
        base = node.args[0]
        if not isinstance(base, fx.Node):
            return None
        node = base
    return node if node.op == "placeholder" else None


def clone_outputs_aliasing_inputs(gm: fx.GraphModule) -> int:
    """Clones, in ``gm``, each output that aliases an input other than a
    shard ([Note: A region returns no alias of its inputs]). Returns how
    many it cloned."""
    out = gm.graph.output_node()
    b = NodeBuilder(gm.graph)
    cloned: dict[fx.Node, fx.Node] = {}
    flat = list(out.args[0])
    for i, value in enumerate(flat):
        if not isinstance(value, fx.Node):
            continue
        base = _aliased_input(value)
        if base is None or _reads_shard(base) or not isinstance(value.meta.get("val"), torch.Tensor):
            continue
        if value not in cloned:
            with gm.graph.inserting_before(out):
                cloned[value] = b(torch.ops.aten.clone.default, value)
        flat[i] = cloned[value]
    if cloned:
        out.args = (type(out.args[0])(flat),) + tuple(out.args[1:])
        gm.recompile()
    return len(cloned)
