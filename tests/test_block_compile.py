"""The torchtitan pattern: ``fully_shard`` per block and the root, then each block
compiled on its own (``block.compile()`` or ``torch.compile(block)`` in its
parent's place), the root running eagerly. Every block gathers and reduces in
graphs, the identical blocks share one compiled graph however deep the model
(the last block hands its gather to a stand-in: [Note: A stand-in for the last
block's next] in compiled_fsdp/core/gated.py), and each block's graph
issues the next block's gather and reduces the next block's gradient, so
communication still overlaps across blocks. See [Note: Blocks compiled on their
own] and [Note: Gathers handed to the next block's graph] in
compiled_fsdp/compile/entry.py."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from compiled_fsdp import explain
from compiled_fsdp.core.registry import CORE
from examples.gpt import GPT, GPTConfig

from _dist import run_distributed
from _graphs import AG, AG_IF, REGATHER, WAIT, GraphCapture, count, count_reduces, saved_gathered
from _models import gpt_case, shard_each
from _parity import assert_close, run_parity


def _deep(n_blocks: int):
    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab=67, dim=24, n_layers=n_blocks, n_heads=2, seq=16))

    return build


def _forward_structure(gm: fx.GraphModule) -> dict:
    """A forward graph's gathers: waited in it, or returned unwaited (the
    handoff); and its waits on graph inputs (a handed-in gather)."""
    outputs = set(gm.graph.output_node().all_input_nodes)
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (AG, AG_IF)]
    waits = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is WAIT]
    return {
        "handed_over": sum(1 for g in gathers if g in outputs and not any(u.target is WAIT for u in g.users)),
        "gathered_here": sum(1 for g in gathers if any(u.target is WAIT for u in g.users)),
        "waits_on_inputs": sum(1 for w in waits if w.args[0].op == "placeholder"),
    }


def _blocks_rank(rank: int, world: int, how: str, backend: str, n_blocks: int) -> dict:
    from torch._dynamo.utils import counters

    from compiled_fsdp.compile.install import last_schedule_reports

    torch._dynamo.reset()
    CORE.backward_gathers.reset()
    counters.clear()
    torch._functorch.config.enable_autograd_cache = False  # count real compiles
    torch._inductor.config.fx_graph_cache = False
    _, make_batch, loss = gpt_case(False)
    capture = GraphCapture() if backend == "aot_eager" else None
    compiler = capture.backend if capture is not None else backend

    def wrap(model: GPT) -> GPT:
        for i, block in enumerate(model.layers):
            if how == "module.compile":
                block.compile(backend=compiler)
            else:
                model.layers[i] = torch.compile(block, backend=compiler)
        return model

    res = run_parity(rank, _deep(n_blocks), shard_each, make_batch, loss, steps=3, wrap=wrap,
                     graph_counts=capture.take_runtime if capture is not None else None,
                     after_step=lambda m: [(r.fqn, r.path, r.units) for r in explain(m)])
    res["unique_graphs"] = counters["stats"]["unique_graphs"]
    res["prefetched_regathers"] = CORE.backward_gathers.taken
    if capture is not None:
        res["graphs"] = (len(capture.forward), len(capture.backward))
        res["forward"] = [_forward_structure(g) for g in capture.forward]
        res["backward"] = [(count(g, AG) + count(g, REGATHER), count_reduces(g)) for g in capture.backward]
        res["saved_gathered"] = [saved_gathered(g) for g in capture.forward]
    res["schedules"] = [(r.graph, r.sequence) for r in last_schedule_reports()]
    return res


@pytest.mark.parametrize("how,n_blocks", [("module.compile", 3), ("torch.compile", 6)])
def test_blocks_share_one_graph_aot_eager(how: str, n_blocks: int) -> None:
    """Bitwise equal to the reference after 3 AdamW steps. One Dynamo graph
    at 3 blocks and at 6, the last block's included: it hands its gather to a
    stand-in, whose collectives the graph skips at run time. Each block but
    the last issues the next block's all-gather in its forward graph and
    returns it unwaited, and reduces the next block's gradient in its backward
    graph;
    each block waits on the gather handed to it and re-gathers in its own
    backward graph (resharded after forward: nothing unsharded is saved),
    through ``regather``, which from the second step on takes the gather
    issued when that backward began (the previous step taught which buckets
    re-gather). The eager root gathers and reduces itself and the first block."""
    n = n_blocks
    for res in run_distributed(_blocks_rank, 2, how, "aot_eager", n, timeout=600):
        assert_close(res, 0.0)
        assert res["unique_graphs"] == 1, res
        assert res["graphs"] == (1, 1)
        assert res["forward"] == [{"handed_over": 1, "gathered_here": 0, "waits_on_inputs": 1}]
        assert res["backward"] == [(1, 1)]  # (re-gathers, reduces)
        assert res["saved_gathered"] == [[]]
        assert res["graph_counts"] == [{"fw_all_gather": n - 1, "bw_all_gather": n,
                                        "bw_reduce_scatter": n - 1}] * 3
        assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 2}] * 3
        assert res["prefetched_regathers"] == 2 * n  # steps 2 and 3
        reports = res["after"][-1]
        assert [(fqn, path) for fqn, path, _ in reports] == [("", "eager")] + [
            (f"layers.{i}", "compiled") for i in range(n)]
        for _, _, units in reports[1:]:  # each block: one unit, handed over
            assert len(units) == 1 and "handed over" in units[0] and "kept" not in units[0], units


def test_blocks_share_one_graph_inductor() -> None:
    """Within 1e-5 of the reference; one Dynamo graph; the schedule issues the
    next block's gather before waiting on the block's own, and in backward
    the next block's reduce overlaps this block's compute; the re-gather is
    taken from the gather issued when the backward began, from step 2 on."""
    for res in run_distributed(_blocks_rank, 2, "module.compile", "inductor", 4, timeout=900):
        assert_close(res, 1e-5)
        assert res["unique_graphs"] == 1
        assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 2}] * 3
        schedules = dict(res["schedules"][:1] + [s for s in res["schedules"] if s[0] == "backward"
                                                 and any("reduce" in e for e in s[1])][:1])
        fw, bw = schedules["forward"], schedules["backward"]
        assert fw == ["all_gather:-2.0", "wait:-1.0"], fw
        assert "reduce_scatter:-2.0" in bw and not any(e.startswith("all_gather") for e in bw), bw
        assert res["prefetched_regathers"] == 2 * 4
