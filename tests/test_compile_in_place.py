"""A root compiled in place (``model.compile()``, as FSDP2's own tests compile
every sharded module) with gradient accumulation without sync, and split by
a graph break, on 2 gloo ranks against the one-process reference. See [Note: A root compiled in
place] in compiled_fsdp/runtime/state.py."""
from __future__ import annotations

import copy
import inspect

import torch

import compiled_fsdp
from compiled_fsdp import fully_shard

from _dist import run_distributed
from _models import BreakBlock, BreakGPT
from _parity import full_diff, full_params, global_batch_steps


class _MLP(torch.nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.in_proj = torch.nn.Linear(dim, dim * mult)
        self.out_proj = torch.nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _rank(rank: int, world: int) -> dict:
    """FSDP2's test_train_parity_hsdp model (1-D here): a parameterless
    ``Sequential`` root over sharded children, which its in-place compiled
    frame calls as Python."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.LayerNorm(16, bias=False), _MLP(16, 3), _MLP(16, 4), _MLP(16, 3))
    model = copy.deepcopy(ref)
    for child in model:
        fully_shard(child)
    fully_shard(model)
    model.compile(backend="aot_eager")  # in place: no OptimizedModule around the call
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + 10 * micro + r))
                  for r in range(world)]
            model(xs[rank]).sum().backward()
            (sum(ref(x).sum() for x in xs) / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = full_params(model)
    return {"diff": full_diff(full, ref),
            "paths": [r.path for r in compiled_fsdp.explain(model)]}


def test_root_compiled_in_place_with_accumulation() -> None:
    """Within 1e-6 of the reference after 3 steps of 3 micro-batches, the
    sync on the last; the children served as fallbacks inside the compiled
    root's forward. Before, they were served as in plain eager, outside the
    iteration the compiled root began, and the parameters came out 0.058 off."""
    for res in run_distributed(_rank, 2):
        assert res["diff"] < 1e-6, res
        assert res["paths"] == ["compiled"] + ["fallback"] * 4, res


def _split_rank(rank: int, world: int) -> dict:
    """A root compiled in place whose reads a break splits (a tied embedding
    and head, and a break inside layers.1 between them), its blocks compile
    regions but layers.1, which breaks the graph."""
    ref = BreakGPT("block", tie_head=True)
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.compile(backend="aot_eager")
    counts = global_batch_steps(rank, world, model, model, ref)
    return {"diff": full_diff(full_params(model), ref), "counts": counts,
            "reports": [(r.fqn, r.path, r.reason) for r in compiled_fsdp.explain(model)]}


def test_root_compiled_in_place_split_by_a_break() -> None:
    """Within 1e-6 of the reference after 3 steps. From the second step the
    root falls back ([Note: Fallback decision rule]): its gather and reduce
    eager, beside layers.1's (a gather each way), layers.0's region still
    compiled in the root's graphs. ``explain()`` says so: before, the root
    said "eager" (its call was not counted as a compiled one), and so did its
    region and, from the second step, layers.1; and the root's break went
    unnamed (the region root's ``forward`` wrapper was searched for it)."""
    lines, first = inspect.getsourcelines(BreakBlock.forward)
    at = first + next(i for i, line in enumerate(lines) if "graph_break()" in line)
    brk = f"Call to `torch._dynamo.graph_break()` at {BreakBlock.forward.__code__.co_filename}:{at}"
    for res in run_distributed(_split_rank, 2):
        assert res["diff"] < 1e-6, res
        assert res["counts"][1:] == [{"all_gather": 3, "reduce_scatter": 2}] * 2, res
        (root, *blocks) = res["reports"]
        assert root[:2] == ("", "fallback") and "more than one Dynamo frame" in root[2], res
        assert "; the break: Call to `torch._dynamo.graph_break()` at " in root[2], res
        assert blocks == [("layers.0", "compiled", None), ("layers.1", "fallback", brk)], res
