"""Pure-FX tests of what the passes do to an outer graph around compile
regions' calls, on hand-built graphs (no process group, nothing run)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from compiled_fsdp.passes.graph import none_from_regions

aten = torch.ops.aten


def _outer(calls: int) -> fx.GraphModule:
    """``calls`` calls of one region whose graph returns an output and a
    None gradient; the outer graph returns each call's output and gradient,
    the first two calls' gradients summed (a block called twice)."""
    body = fx.Graph()
    x = body.placeholder("x")
    body.output((body.call_function(aten.mul.Tensor, (x, x)), None))
    root = torch.nn.Module()
    root.body = fx.GraphModule(torch.nn.Module(), body)
    g = fx.Graph()
    x = g.placeholder("x")
    region = g.get_attr("body")
    outs, grads = [], []
    for _ in range(calls):
        call = g.call_function(torch.ops.higher_order.invoke_subgraph, (region, "body_id", x))
        outs.append(g.call_function(operator.getitem, (call, 0)))
        grads.append(g.call_function(operator.getitem, (call, 1)))
    twice = g.call_function(aten.add.Tensor, (grads[0], grads[1]))
    g.output((*outs, twice, *grads[2:]))
    return fx.GraphModule(root, g)


def test_none_from_regions_rewrites_the_output_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradients a region's graph returns as None, and their sum, become
    None in the outer graph's output, which is rewritten once for all of
    them ([Note: One pass over the output] in passes/graph.py): a rewrite
    each was quadratic in a whole model's depth."""
    calls = 8
    gm = _outer(calls)
    written = []
    args = fx.Node.args

    def counted(node: fx.Node, value: tuple) -> None:
        if node.op == "output":
            written.append(node)
        args.fset(node, value)

    monkeypatch.setattr(fx.Node, "args", property(args.fget, counted))
    assert none_from_regions(gm) == calls
    monkeypatch.undo()
    out = gm.graph.output_node().args[0]
    assert out[calls:] == (None,) * (calls - 1), out
    assert all(n.target is operator.getitem and n.args[1] == 0 for n in out[:calls])
    assert not [n for n in gm.graph.nodes if n.target is aten.add.Tensor
                or n.target is operator.getitem and n.args[1] == 1]
    assert len(written) == 1, len(written)
