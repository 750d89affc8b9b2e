"""Blocks as compile regions (``config.comm.block_regions``, on by default):
``torch.compile(model, fullgraph=True)`` of a sharded model whose identical
blocks Dynamo traces once and every block calls as one subgraph, gathered and
reduced inside it by the passes. See [Note: Blocks as compile regions] in
compiled_fsdp/compile/regions.py."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import fully_shard
from examples.gpt import GPT, GPTConfig

from _dist import run_distributed
from _models import shard_each
from _parity import assert_close, in_regions, run_parity, whole

BLOCKS = 3


@contextlib.contextmanager
def _caught(about: str) -> Iterator[list[str]]:
    """The messages of the warnings raised inside that mention ``about``
    (filled when the block ends)."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found.extend(str(w.message) for w in caught if about in str(w.message))


@contextlib.contextmanager
def _schemas() -> Iterator[list[int]]:
    """Counts the calls that reach torch's own ``invoke_subgraph.gen_schema``."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    calls: list[int] = []
    original = InvokeSubgraphHOP.gen_schema

    def counted(self: Any, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    InvokeSubgraphHOP.gen_schema = counted
    try:
        yield calls
    finally:
        InvokeSubgraphHOP.gen_schema = original


def _stack_parity(rank: int, build: Any, steps: int, **kwargs: Any) -> dict:
    """A stack of toy blocks, sharded and compiled whole under ``aot_eager``,
    against its reference: a fresh random batch a step, the output's mean square."""
    return run_parity(rank, build, shard_each, lambda step: (torch.randn(4, 8, generator=torch.Generator(
        ).manual_seed(10 * step)),), lambda out, x: out.square().mean(), steps=steps,
        wrap=partial(torch.compile, backend="aot_eager"), **kwargs)


def _build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=67, dim=24, n_layers=BLOCKS, n_heads=2, seq=16))


def _depth(source: Any) -> int:
    """How many steps ``source`` (Dynamo's) takes from its frame's local or global."""
    steps = 0
    while hasattr(source, "base"):
        source, steps = source.base, steps + 1
    return steps


def _a_regions_shard(source: Any) -> bool:
    """Whether ``source`` is an item of a region entry's ``region_shards``
    (``..._fsdp_region_entry ... .region_shards[3]``; not the root's, reached
    through its parameters' group)."""
    if getattr(getattr(source, "base", None), "member", None) != "region_shards":
        return False
    while hasattr(source, "base"):
        source = source.base
        if getattr(source, "index", None) == "_fsdp_region_entry":
            return True
    return False


def _regions_rank(rank: int, world: int, backend: str) -> dict:
    from torch._dynamo.backends.registry import lookup_backend

    from compiled_fsdp.compile.install import recording
    from compiled_fsdp.tools.models import batch, loss_fn

    torch._functorch.config.enable_autograd_cache = False  # a cache hit skips the passes (no report)
    torch._inductor.config.fx_graph_cache = False
    compiled_fsdp.config.comm.block_regions = True
    cfg = _build().cfg
    graphs: list[dict[str, Any]] = []

    def backend_fn(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        calls = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.target is torch.ops.higher_order.invoke_subgraph]
        sources = [n.meta["grapharg"].source for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append({"subgraphs": sorted(name for name, _ in gm.named_children() if name.startswith("subgraph")),
                       "calls": len(calls),
                       "dtensor_inputs": sum(isinstance(t, torch.distributed.tensor.DTensor) for t in inputs),
                       "shard_depths": sorted({_depth(s) for s in sources if _a_regions_shard(s)})})
        return lookup_backend(backend)(gm, inputs)


    model_of: list[GPT] = []

    def wrap(model: GPT) -> Any:
        model_of.append(model)
        return torch.compile(model, backend=backend_fn, fullgraph=True)

    from compiled_fsdp.core.registry import CORE

    CORE.backward_gathers.reset()
    CORE.later_reduces.reset()
    with recording() as rec, _caught("traced the compile region") as retraced, _schemas() as schemas:
        res = run_parity(rank, _build, shard_each, lambda step: (batch(cfg, 2, step),), loss_fn, wrap=wrap,
                         after_step=lambda m: (CORE.backward_gathers.taken, CORE.later_reduces.delivered))
    res["retraced"] = retraced
    res["schemas"] = len(schemas)
    res["schema_memo_left"] = "gen_schema" in vars(torch.ops.higher_order.invoke_subgraph)
    res["graphs"] = graphs
    res["explain"] = [(r.fqn, r.path, r.units[:1] and r.units[0].split(" (")[0])
                      for r in compiled_fsdp.explain(model_of[0])]
    res["root_units"] = compiled_fsdp.explain(model_of[0])[0].units
    res["joint"] = sorted((r.lowering.count("gather"), r.lowering.count("reduce")) for r in rec.joint)
    return res


@pytest.mark.parametrize("backend,tol", [("aot_eager", 0.0), ("inductor", 2e-6)])
def test_identical_blocks_compile_once(backend: str, tol: float) -> None:
    """One Dynamo graph whose three blocks call one subgraph (traced once,
    partitioned and compiled once), the region's gathers and reductions
    lowered inside it (one bucket each), the root's in the outer graph; no
    eager collective. After 3 steps, equal to the single-process reference
    (eager, unsharded): bitwise under ``aot_eager``; under Inductor within
    2e-6 in the loss and the gradients (1e-6 measured), and within 1e-4 in
    the parameters, where AdamW's first step turns a gradient the reference
    has exactly 0 and Inductor's float order ~1e-10 into ~lr/40 (2.5e-5 on
    one rank). Before [Note: A region returns no alias of its inputs] the
    last block's saved input was overwritten by the final norm: 2e-3 in the
    gradients in the first step. Without [Note: Blocks as compile regions]'s three changes
    Dynamo makes a subgraph per block and inlines each (none remains), or
    fails (a DTensor input), or the markers stay unlowered (eager collectives).
    From the second step on (once each bucket's re-gathers have run), every
    block takes the gather the outer graph issued ahead of it ([Note: Gathers
    issued ahead of compile regions]), and every block's backward takes a
    gather issued ahead: the last block's, issued when the root's forward
    returned, the others' by the backward of the block after them. Every
    block's reduce-scatter is waited after its region's backward graph
    ([Note: A region's reduce-scatter waited outside its graph]: the graph
    waited it, all of it exposed). The root's units are cut at the
    regions' calls, as at the blocks' reads in one graph: the final norm
    joins the head (with the root's reads before the regions, it was
    gathered again in backward). The outer graph takes no DTensor: the
    root's reads take plain aliases too."""
    for res in run_distributed(_regions_rank, 2, backend, timeout=900):
        assert_close({**res, "param": [0.0]}, tol)  # (the loss and the gradients)
        assert max(res["param"]) <= (1e-4 if backend == "inductor" else 0.0), res["param"]
        assert res["counts"] == [{}] * 3
        # (gathers taken from the second step: BLOCKS in forward and BLOCKS in backward;
        # each step, every region's reduce waited after its graph)
        assert res["after"] == [(0, BLOCKS), (2 * BLOCKS, 2 * BLOCKS), (4 * BLOCKS, 3 * BLOCKS)], res["after"]
        depths = res["graphs"][0].pop("shard_depths")
        # (no DTensor input: [Note: No DTensor inputs beside regions])
        assert res["graphs"] == [{"subgraphs": ["subgraph_0"], "calls": BLOCKS, "dtensor_inputs": 0}]
        # (the regions' shards, not the root's: the first region's reached through its module,
        # every other's through the one list of regions, at one depth: [Note: One source per
        # region]; through the entry before it, block k's were k steps deeper)
        assert len(depths) == 2 and depths[1] - depths[0] == 2, depths
        # (traced once: the last block's token, made without the issue-ahead op, required no
        # gradient where the others' did, and Dynamo traced the region again for it)
        assert res["retraced"] == [], res["retraced"]
        # (torch's schema of the region made about three times in the trace, not twice a block:
        # [Note: One schema per region]; without the memo 2 * BLOCKS + 2 on 2.15; torch's own
        # method back after)
        assert 1 <= res["schemas"] <= 3 and not res["schema_memo_left"], res["schemas"]
        # (the region's joint graph: its block's bucket; the outer one: the root's units)
        assert (1, 1) in res["joint"] and len(res["joint"]) == 2, res["joint"]
        assert res["explain"][0][:2] == ("", "compiled")  # (the root: the outer graph's units)
        # (the final norm joins the head, not the root's reads before the regions: kept for
        # backward, not gathered again; the regions' calls part the outer graph's units)
        last = res["root_units"][-1]
        assert last.startswith("unit 2: norm, head,") and "kept from forward to backward" in last, last
        assert res["explain"][1:] == [(f"layers.{i}", "compiled", "a compile region") for i in range(BLOCKS)]


def _regions_cut_rank(rank: int, world: int, split: bool, backend: str) -> dict:
    from compiled_fsdp.passes.config import overlap

    overlap.bucket_bytes = 0  # (nothing merges: the tiny block's parts gathered apart)
    overlap.split_regions = split
    return _regions_rank(rank, world, backend)


@pytest.mark.parametrize("split,backend,tol", [(True, "aot_eager", 0.0), (True, "inductor", 2e-6),
                                               (False, "aot_eager", 0.0)], ids=["cut", "cut-inductor", "whole"])
def test_regions_cut_take_their_parts_issued_ahead(split: bool, backend: str, tol: float) -> None:
    """[Note: Every compile region cut as the opening block]: with nothing
    merged, the region's graph gathers and reduces its block in four parts
    (the modules it calls: two norms, the attention, the MLP), and every part is
    taken from a gather issued ahead from the second step on, forward and
    backward, though the outer graph and the backward chain name the
    region's whole bucket ([Note: A bucket issued in the parts its graph
    takes]); each part's reduce waited after the region's graph. Bitwise
    equal to the reference after 3 steps under ``aot_eager``; under
    Inductor as close as ``test_identical_blocks_compile_once`` asks. With
    ``split_regions`` off (the default) the block is one bucket."""
    parts = 4 if split else 1
    for res in run_distributed(_regions_cut_rank, 2, split, backend, timeout=900):
        assert_close({**res, "param": [0.0]}, tol)  # (the loss and the gradients)
        assert max(res["param"]) <= (1e-4 if backend == "inductor" else 0.0), res["param"]
        assert res["counts"] == [{}] * 3
        assert (parts, parts) in res["joint"] and len(res["joint"]) == 2, res["joint"]
        n = parts * BLOCKS
        assert res["after"] == [(0, n), (2 * n, 2 * n), (4 * n, 3 * n)], res["after"]


def _in_place(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    model.compile(backend=backend)
    return model


def _break_rank(rank: int, world: int, in_place: bool) -> dict:
    from _models import break_case

    compiled_fsdp.config.comm.block_regions = True
    build, make_batch, loss = break_case("block")  # layers.1, a block of another class, breaks inside


    def after_step(model: torch.nn.Module) -> dict:
        return {"paths": [(r.fqn, r.path) for r in compiled_fsdp.explain(model)], "regions": in_regions(model)}

    with _caught("compile region") as found:
        res = run_parity(rank, build, shard_each, make_batch, loss, steps=3, after_step=after_step,
                         wrap=partial(_in_place, backend="aot_eager") if in_place
                         else partial(torch.compile, backend="aot_eager"))
    res["warnings"] = found
    return res


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile(model)", "model.compile()"])
def test_a_region_that_breaks_the_graph_falls_back(in_place: bool) -> None:
    """A block that breaks the graph inside its region (layers.1, of another
    class than layers.0) stops being a region at the first trace and falls
    back to the eager runtime, as without regions: gathered eagerly in
    forward and again in backward, reduced eagerly once, every step, with
    one warning that names its class; layers.0 stays a region and the root
    stays compiled. After 3 steps bitwise equal to the single-process
    reference under ``aot_eager``. Without [Note: A region that breaks the
    graph] the first forward raised Dynamo's ``UncapturedHigherOrderOpError``."""
    for res in run_distributed(_break_rank, 2, in_place, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 1}] * 3, (res["counts"], res["after"])
        assert res["after"][-1]["paths"] == [("", "compiled"), ("layers.0", "compiled"),
                                             ("layers.1", "fallback")], res["after"][-1]
        assert res["after"][-1]["regions"] == [False, True, False], res["after"][-1]
        assert len(res["warnings"]) == 1 and "'BreakBlock'" in res["warnings"][0], res["warnings"]


def _root_rank(rank: int, world: int, api: str) -> dict:
    from compiled_fsdp import replicate

    from _models import break_case

    compiled_fsdp.config.comm.block_regions = True
    build, make_batch, loss = break_case("block")  # layers.1 breaks the graph; only the root is sharded

    def after_step(model: torch.nn.Module) -> dict:
        return {"paths": [(r.fqn, r.path) for r in compiled_fsdp.explain(model)], "regions": in_regions(model),
                "class": type(model).__name__}

    return run_parity(rank, build, fully_shard if api == "fully_shard" else replicate, make_batch, loss, steps=3,
                      after_step=after_step, wrap=partial(torch.compile, backend="aot_eager"))


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_a_root_is_no_region(api: str) -> None:
    """The root alone sharded (``fully_shard(model)``, ``replicate(model)``)
    is no region (a module becomes one when a module above it is sharded): a
    graph break inside it (layers.1) splits the root's graph as without
    regions. Bitwise equal to the reference after 3 steps under
    ``aot_eager``. When every sharded module without sharded ones below it
    became a region at its own ``fully_shard``, the first forward raised
    Dynamo's ``UncapturedHigherOrderOpError`` (no root above the region to
    fall back; found with regions on by default, tests/test_hsdp.py's
    replicate case)."""
    for res in run_distributed(_root_rank, 2, api, timeout=900):
        if api == "fully_shard":
            assert_close(res, 0.0)
        else:  # (the harness compares sharded gradients: the losses, every rank's batch the same)
            assert res["loss"] == [0.0] * 3, res["loss"]
        last = res["after"][-1]
        assert last["regions"] == [False] and last["class"] == "FSDPBreakGPT", last
        assert last["paths"][0][0] == "", last


def _partly_run_rank(rank: int, world: int) -> dict:
    from _models import BreakBlock, BreakGPT, gpt_batch, gpt_loss

    compiled_fsdp.config.comm.block_regions = True
    model = BreakGPT("between")  # (a break in the root's forward, between its blocks)
    model.layers[1].__class__ = BreakBlock
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager")
    tokens = gpt_batch(model.cfg, 2, 0)
    out: dict = {}
    try:
        compiled(tokens)
    except Exception as exc:  # noqa: BLE001 (the message is the result)
        out["error"] = "\n".join([type(exc).__name__, *getattr(exc, "__notes__", [])])
    losses = []
    for _ in range(2):
        compiled_fsdp.reset_collective_counts()
        loss = gpt_loss(compiled(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
        out["counts"] = compiled_fsdp.collective_counts()
    out["paths"] = [(r.fqn, r.path) for r in compiled_fsdp.explain(model)]
    out["finite"] = all(torch.isfinite(torch.tensor(losses)).tolist())
    return out


def test_a_region_that_breaks_after_part_of_the_step_ran_is_not_run_twice() -> None:
    """A break in the root's forward before the breaking block: the compile
    that raises is the resume function's, after the first part of the
    forward ran, so the forward is not called again (a step is never run
    twice): the error stands, on every rank, with a note; the next steps run
    layers.1 as a plain module that falls back ([Note: A region that breaks
    the graph])."""
    for res in run_distributed(_partly_run_rank, 2, timeout=900):
        assert "UncapturedHigherOrderOpError" in res["error"] and "not run again" in res["error"], res
        assert res["paths"] == [("", "compiled"), ("layers.0", "compiled"), ("layers.1", "fallback")], res
        assert res["counts"] == {"all_gather": 2, "reduce_scatter": 1} and res["finite"], res


def _inlined_root_rank(rank: int, world: int) -> str:
    compiled_fsdp.config.comm.block_regions = True
    model = _build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(0, 67, (2, 16))
    try:
        torch.compile(lambda t: model(t), backend="aot_eager")(tokens)
    except Exception as exc:  # noqa: BLE001 (the message is the result)
        return str(exc)
    return "no error"


def test_regions_under_a_compiled_caller_are_a_clear_error() -> None:
    """A function that calls the sharded root, compiled, traces the root's
    hooks, so nothing prepares the regions' settings before they are traced
    (the root's pre-forward, run as Python, does under ``torch.compile(model)``):
    an error, on every rank, that says so and what to do (it was a
    ``JSONDecodeError`` from inside Dynamo)."""
    for message in run_distributed(_inlined_root_rank, 2, timeout=900):
        assert "traces its sharded root's call" in message and "block_regions = False" in message, message


def _own_frames_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.tools.models import batch, loss_fn

    compiled_fsdp.config.comm.block_regions = True
    cfg = _build().cfg


    def compile_blocks(model: GPT) -> GPT:
        for block in model.layers:
            block.compile(backend="aot_eager", fullgraph=True)
        return model

    return run_parity(rank, _build, shard_each, lambda step: (batch(cfg, 2, step),), loss_fn, wrap=compile_blocks,
                      after_step=in_regions)


def test_blocks_compiled_on_their_own_run_their_plain_forward() -> None:
    """With the setting on, blocks compiled on their own (torchtitan's
    pattern, each block one frame already) run their plain forward, not the
    region: they hand gathers along as always and train bitwise equal to the
    reference (a region there read the DTensor inside the subgraph:
    ``'FakeTensor' object has no attribute 'to_local'``)."""
    for res in run_distributed(_own_frames_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert not any(any(step) for step in res["after"]), res["after"]  # (explain(): no region)


def _last_kept_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.core.registry import CORE
    from compiled_fsdp.tools.models import batch, loss_fn

    compiled_fsdp.config.comm.block_regions = True
    cfg = _build().cfg

    def shard(model: GPT) -> None:  # (torchtitan's recipe: the last block kept from forward)
        for i, block in enumerate(model.layers):
            fully_shard(block, reshard_after_forward=i < BLOCKS - 1)
        fully_shard(model)

    gathers = CORE.backward_gathers
    gathers.reset()
    return run_parity(rank, _build, shard, lambda step: (batch(cfg, 2, step),), loss_fn,
                      wrap=lambda m: torch.compile(m, backend="aot_eager", fullgraph=True),
                      after_step=lambda m: (gathers.taken, len(gathers.pending)))


def test_last_block_kept_from_forward() -> None:
    """The last block not resharded after forward (its own region: another
    trace), the others regions: bitwise equal to the reference. Its backward
    gathers nothing, so nothing is issued for it when the root's forward
    returns (a gather issued there would stay pending, kept, past the
    optimizer step: before backward gathers were told from forward ones, it
    was): the second block's is, the first backward that gathers. From the
    second step the forward takes 3 gathers issued ahead and the backward 2."""
    for res in run_distributed(_last_kept_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{}] * 3
        assert res["after"] == [(0, 0), (5, 0), (10, 0)], res["after"]


def _root_said_no_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.tools.models import batch, loss_fn

    cfg = _build().cfg

    def shard(model: GPT) -> None:  # (the setting on for the blocks, off for the root)
        compiled_fsdp.config.comm.block_regions = True
        for block in model.layers:
            fully_shard(block)
        compiled_fsdp.config.comm.block_regions = False
        fully_shard(model)

    return run_parity(rank, _build, shard, lambda step: (batch(cfg, 2, step),), loss_fn,
                      wrap=lambda m: torch.compile(m, backend="aot_eager", fullgraph=True),
                      after_step=lambda m: [(r.fqn, r.path, r.reason) for r in compiled_fsdp.explain(m)])


def test_blocks_under_a_root_sharded_without_regions() -> None:
    """Blocks sharded with the setting on under a root sharded with it off
    are no regions (the root's one graph reads them), train bitwise, and
    ``explain()`` says why (it said nothing: a user who asked saw no region
    and no reason)."""
    for res in run_distributed(_root_said_no_rank, 2, timeout=900):
        assert_close(res, 0.0)
        last = res["after"][-1]
        assert last[0] == ("", "compiled", None), last
        for fqn, path, reason in last[1:]:
            assert path == "compiled" and "block_regions off" in reason, (fqn, reason)
        assert [fqn for fqn, _, _ in last[1:]] == [f"layers.{i}" for i in range(BLOCKS)]


def _setting_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.tools.models import batch, loss_fn

    compiled_fsdp.config.comm.block_regions = True
    model = _build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = batch(model.cfg, 2, rank)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    grads = []
    for factor in (None, None, 1.0):  # (the same parameters each time: no optimizer step)
        if factor is not None:  # (the blocks only: the root's reads, outside regions, guard their own)
            for block in model.layers:
                block.set_gradient_divide_factor(factor)
        loss_fn(compiled(tokens), tokens).backward()
        grads.append({n: whole(p.grad) for n, p in model.named_parameters() if n.startswith("layers.")})
        model.zero_grad(set_to_none=True)
    return {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames,
            "mean": max((grads[1][n] - g).abs().max().item() for n, g in grads[0].items()),
            "sum": max((grads[2][n] / world - g).abs().max().item() for n, g in grads[0].items())}


def test_a_setting_changed_between_steps_recompiles() -> None:
    """A region's reads take their settings from one guarded key ([Note: A
    region's read settings] in regions.py): ``set_gradient_divide_factor(1.0)``
    on the blocks after two steps changes it, the frame is traced again, and
    the blocks' gradients come out as the sum over ranks, exactly ``world``
    times the mean (without the guard the reused graph would still divide:
    the mean)."""
    for res in run_distributed(_setting_rank, 2, timeout=900):
        assert res["mean"] == 0.0 and res["sum"] == 0.0, res
        assert res["graphs"] == 2, res


class _TwiceGPT(GPT):
    """Runs its first block twice: one region called twice a step, whose two
    backwards each reduce (the outer graph summed their gradients)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in (self.layers[0], *self.layers):
            x = block(x)
        return self.head(self.norm(x))


def _twice_rank(rank: int, world: int, backend: str) -> dict:
    from compiled_fsdp.core.registry import CORE
    from compiled_fsdp.tools.models import batch, loss_fn

    compiled_fsdp.config.comm.block_regions = True

    def build() -> GPT:
        torch.manual_seed(0)
        return _TwiceGPT(GPTConfig(vocab=67, dim=24, n_layers=BLOCKS, n_heads=2, seq=16))


    CORE.later_reduces.reset()
    return run_parity(rank, build, shard_each, lambda step: (batch(build().cfg, 2, step),), loss_fn,
                      wrap=lambda m: torch.compile(m, backend=backend, fullgraph=True),
                      after_step=lambda m: CORE.later_reduces.delivered)


@pytest.mark.parametrize("backend,tol", [("aot_eager", 0.0), ("inductor", 2e-6)])
def test_a_region_called_twice(backend: str, tol: float) -> None:
    """A block called twice a step: each call's backward reduces after its
    region ([Note: A region's reduce-scatter waited outside its graph]), the
    first block's two rows added to its gradient, BLOCKS + 1 reduces a step;
    the outer graph's sum of the two calls' gradients, None and None, is
    None (``none_from_regions`` in passes/graph.py; ``aten.add`` of None
    raised). Bitwise under ``aot_eager``."""
    for res in run_distributed(_twice_rank, 2, backend, timeout=900):
        assert_close({**res, "param": [0.0]}, tol)
        assert max(res["param"]) <= (1e-4 if backend == "inductor" else 0.0), res["param"]
        assert res["after"] == [(BLOCKS + 1) * step for step in (1, 2, 3)], res["after"]


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor


class _DataclassGPT(GPT):
    """Returns its logits in a dataclass: a pytree leaf, so no hook of ours
    sees a tensor output to wait for its backward."""

    def forward(self, tokens: torch.Tensor) -> _Out:  # type: ignore[override]
        return _Out(super().forward(tokens))


def _dataclass_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.tools.models import batch, loss_fn

    compiled_fsdp.config.comm.block_regions = True

    def build() -> GPT:
        torch.manual_seed(0)
        return _DataclassGPT(GPTConfig(vocab=67, dim=24, n_layers=BLOCKS, n_heads=2, seq=16))


    return run_parity(rank, build, shard_each, lambda step: (batch(build().cfg, 2, step),),
                      lambda out, tokens: loss_fn(out.logits, tokens),
                      wrap=lambda m: torch.compile(m, backend="aot_eager", fullgraph=True))


def test_gradients_arrive_whatever_the_output() -> None:
    """A root whose output is a dataclass (no tensor our hooks can find):
    every gradient still reaches its ``DTensor`` in the backward that made it
    (the aliases' hooks, [Note: Blocks as compile regions] (2)), bitwise
    equal to the reference after 3 steps. When the move waited on a callback
    queued from the outputs, none was queued: the gradients stayed on the
    aliases, and the step updated nothing."""
    for res in run_distributed(_dataclass_rank, 2, timeout=900):
        assert_close(res, 0.0)
