"""Graph breaks: the modules a break touches fall back to the eager runtime,
everything else stays compiled, and every parameter is communicated exactly once
per use window. See [Note: Fallback decision rule] in compiled_fsdp/compile/frames.py."""
from __future__ import annotations

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import explain, fully_shard

from _dist import run_distributed
from _graphs import GraphCapture, one_graph
from _models import break_case
from _parity import assert_close, run_parity

STEPS = 4


def _rank(rank: int, world: int, where: str, tied: bool, reshard: bool, backend: str) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    torch._dynamo.reset()
    build, make_batch, loss = break_case(where, tied)
    capture = GraphCapture()

    def shard(model):
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)

    return run_parity(
        rank, build, shard, make_batch, loss, steps=STEPS,
        wrap=lambda m: torch.compile(m, backend=capture.backend if backend == "capture" else backend),
        graph_counts=capture.take_runtime,
        after_step=_after_step,
    )


def _after_step(model: torch.nn.Module) -> dict:
    """explain()'s verdicts, and the eager collectives that reading parameters and
    the state dict between steps issued (must be none)."""
    compiled_fsdp.reset_collective_counts()
    model.state_dict()
    _ = [model.layers[0].mlp.up.weight, model.head.weight]
    reads = compiled_fsdp.collective_counts()
    return {"explain": {r.fqn: (r.path, r.reason) for r in explain(model)}, "reads": reads}


def _steps(counts: dict, graph: dict) -> list:
    return [(counts, graph)] * STEPS


# Per case: (eager collectives, in-graph collectives) per step, and the modules
# that fall back. The root is "", cut into units per fragment graph (each
# fragment keeps its last-used unit); blocks reshard iff `reshard`.
CASES = {
    # layers.1 breaks inside: it falls back (gathered eagerly in forward and again in
    # backward, reduced eagerly once). The root's forward is split into two frames
    # around the eager call; each fragment gathers the root parameters it reads
    # (embedding/pos, then norm/head), layers.0 stays in the first fragment.
    ("block", False, True): (
        _steps({"all_gather": 2, "reduce_scatter": 1},
               {"fw_all_gather": 3, "bw_all_gather": 1, "bw_reduce_scatter": 3}),
        {"layers.1"},
    ),
    # The same with a data-dependent `if`, not resharding: no backward re-gathers.
    ("data_dep", False, False): (
        _steps({"all_gather": 1, "reduce_scatter": 1}, {"fw_all_gather": 3, "bw_reduce_scatter": 3}),
        {"layers.1"},
    ),
    # A break between blocks in the root's forward: every child stays compiled,
    # the root's leftovers are gathered by the fragment that reads them.
    ("between", False, True): (
        _steps({}, {"fw_all_gather": 4, "bw_all_gather": 2, "bw_reduce_scatter": 4}),
        set(),
    ),
    # The same with the head tied to the embedding: the tied weight is read on both
    # sides of the break, so after the first step the root falls back (one eager
    # gather, one eager reduce-scatter); the first step gathers per fragment.
    ("between", True, True): (
        [({}, {"fw_all_gather": 4, "bw_all_gather": 2, "bw_reduce_scatter": 4})]
        + [({"all_gather": 1, "reduce_scatter": 1}, {"fw_all_gather": 2, "bw_all_gather": 2, "bw_reduce_scatter": 2})]
        * (STEPS - 1),
        {""},
    ),
    # layers.0 breaks inside and is called twice: two eager gathers in forward (it
    # reshards between the calls), one in backward, one reduce-scatter for both uses.
    # The first fragment reads only the root's embed and pos, which are the
    # graph's largest pieces there, so the 1/8 rule keeps them apart: two units
    # (see [Note: Units]); norm and head merge in the last fragment.
    ("twice", False, True): (
        _steps({"all_gather": 3, "reduce_scatter": 1},
               {"fw_all_gather": 4, "bw_all_gather": 1, "bw_reduce_scatter": 4}),
        {"layers.0"},
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}-reshard{c[2]}")
def test_fallback_counts_and_parity(case: tuple) -> None:
    expected, fallback = CASES[case]
    for res in run_distributed(_rank, 2, *case, "capture"):
        assert_close(res, 0.0)  # aot_eager partitioning: bitwise with the reference
        assert list(zip(res["counts"], res["graph_counts"])) == expected
        assert all(after["reads"] == {} for after in res["after"])
        last = res["after"][-1]["explain"]
        assert {fqn for fqn, (path, _) in last.items() if path == "fallback"} == fallback
        assert all(path == "compiled" for fqn, (path, _) in last.items() if fqn not in fallback)
        for fqn in fallback:  # the reason names the break
            reason = last[fqn][1]
            assert reason and ("graph_break()" in reason or "generic_jump" in reason), reason


def test_fallback_under_inductor() -> None:
    for res in run_distributed(_rank, 2, "block", False, True, "inductor", timeout=900):
        assert_close(res, 1e-5)
        assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 1}] * STEPS
        assert res["after"][-1]["explain"]["layers.1"][0] == "fallback"


def test_a_break_inside_the_blocks_loop_says_so() -> None:
    """A block that breaks the graph, called in the root's ``for`` loop over
    its blocks: Dynamo cannot resume inside a loop, so it skips the root's
    frame and runs it as Python (FSDP2's model would run eagerly too), and
    every module communicates through the eager runtime, bitwise equal to
    the reference after 4 steps under ``aot_eager``. explain() says so: the
    root names Dynamo's skip and the break, the breaking block its break,
    the other block its root (before: a dispatch mode or the recompile
    limit for the root, nothing for the other block)."""
    for res in run_distributed(_rank, 2, "loop", False, True, "aot_eager"):
        assert_close(res, 0.0)
        # (root, both blocks, and both again in backward; one reduce each)
        assert res["counts"] == [{"all_gather": 5, "reduce_scatter": 3}] * STEPS, res["counts"]
        last = res["after"][-1]["explain"]
        assert {fqn: path for fqn, (path, _) in last.items()} == {
            "": "fallback", "layers.0": "fallback", "layers.1": "fallback"}, last
        assert last[""][1].startswith("Dynamo skipped its forward's frame") and "graph_break()" in last[""][1], last
        assert "graph_break()" in last["layers.1"][1], last
        assert last["layers.0"][1].startswith("its root's forward ran untraced"), last
