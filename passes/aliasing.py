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
bitwise). So each output of a region's forward or backward graph that
shares storage with an input of that graph (the input, a view, a piece of
a split: compared on the fake values' storages) is cloned there, unless
that input is one the markers read (a shard, a kept gradient), tagged on
the joint graph before the markers are lowered (``mark_marker_inputs``):
the outer graph takes those from its own inputs, whose buffers Inductor
never reuses, and a clone of a shard would cost memory and key the
backward's re-gather by the clone's storage, losing its prefetch. A clone
costs one copy of the block's input a step; the input's buffer is freed.
Tested by tests/test_block_regions.py::test_identical_blocks_compile_once
[inductor], against the single-process reference, and by
tests/test_passes_fx.py::test_region_outputs_aliasing_inputs_are_cloned.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .graph import NodeBuilder, is_marker

__all__ = ["clone_outputs_aliasing_inputs", "mark_marker_inputs"]

# Set on a placeholder of a region's joint graph that a marker reads (the
# partitioner copies placeholders' meta into the graphs it makes).
MARKER_INPUT = "compiled_fsdp_marker_input"


def _storage(node: object) -> StorageWeakRef | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def mark_marker_inputs(joint: fx.GraphModule) -> None:
    """Tags each placeholder of ``joint`` whose storage a marker op reads
    (before the lowering replaces the markers)."""
    read = {_storage(a) for n in joint.graph.nodes if is_marker(n) for a in n.all_input_nodes} - {None}
    for p in joint.graph.find_nodes(op="placeholder"):
        if _storage(p) in read:
            p.meta[MARKER_INPUT] = True


def clone_outputs_aliasing_inputs(gm: fx.GraphModule) -> int:
    """Clones, in ``gm``, each output that shares storage with an input not
    tagged by ``mark_marker_inputs`` ([Note: A region returns no alias of
    its inputs]). Returns how many it cloned."""
    inputs = {_storage(p) for p in gm.graph.find_nodes(op="placeholder") if not p.meta.get(MARKER_INPUT)} - {None}
    out = gm.graph.output_node()
    b = NodeBuilder(gm.graph)
    cloned: dict[fx.Node, fx.Node] = {}
    flat = list(out.args[0])
    for i, value in enumerate(flat):
        if not isinstance(value, fx.Node) or _storage(value) not in inputs:
            continue
        if value not in cloned:
            with gm.graph.inserting_before(out):
                cloned[value] = b(torch.ops.aten.clone.default, value)
        flat[i] = cloned[value]
    if cloned:
        out.args = (type(out.args[0])(flat),) + tuple(out.args[1:])
        gm.recompile()
    return len(cloned)
