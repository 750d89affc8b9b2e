"""A single ``fully_shard(model)`` under compile: the passes cut the root into
units ([Note: Units] in passes/units.py), gathered and reduced layer by layer,
with the reference's numerics."""
from __future__ import annotations

import pytest
import torch

from compiled_fsdp import explain, fully_shard

from _dist import run_distributed
from _graphs import AG, GraphCapture, count, count_reduces, resharded_gathers, saved_gathered
from _models import Twice, gpt_case, twice_batch, twice_loss
from _parity import assert_close, run_parity


def _case(name: str):
    if name == "twice":
        return Twice, twice_batch, twice_loss
    return gpt_case(tied=name == "tied")


def _single_rank(rank: int, world: int, case: str, backend: str) -> dict:
    from torch._dynamo.utils import counters

    from compiled_fsdp.compile.install import recording

    torch._dynamo.reset()
    counters.clear()
    torch._functorch.config.enable_autograd_cache = False  # a cache hit skips the passes
    torch._inductor.config.fx_graph_cache = False
    build, make_batch, loss = _case(case)
    capture = GraphCapture() if backend == "aot_eager" else None
    with recording() as rec:
        res = run_parity(
            rank, build, fully_shard, make_batch, loss, steps=3,
            wrap=lambda m: torch.compile(m, backend=capture.backend if capture else backend, fullgraph=True),
            graph_counts=capture.take_runtime if capture else None,
            after_step=lambda m: [(r.fqn, r.path, r.units) for r in explain(m)],
        )
    (joint,) = rec.joint  # one joint graph, compiled once
    low = joint.lowering
    res["units"] = [(u.modules, u.reshard_after_forward) for u in low.units]
    res["buckets"] = [(b.kind, b.reshard_after_forward) for b in low.buckets]
    res["unique_graphs"] = counters["stats"]["unique_graphs"]
    if capture is not None:
        fw, bw = capture.forward, capture.backward
        res["graphs"] = (len(fw), len(bw))
        res["fw"] = (count(fw[0], AG), count_reduces(fw[0]), len(resharded_gathers(fw[0])))
        res["bw"] = (count(bw[0], AG), count_reduces(bw[0]))
        res["saved_gathered"] = saved_gathered(fw[0])
    return res


# pos (the root's own read) is small and joins embed; norm joins layers.1.
GPT_UNITS = [("embed", "<compiled module> (own reads)"), ("layers.0",), ("layers.1", "norm"), ("head",)]


@pytest.mark.parametrize("case", ["gpt", "tied", "twice"])
def test_single_call_aot_eager(case: str) -> None:
    """Bitwise equal to the reference; one graph per direction; one all-gather
    per gather bucket in forward, one more in backward per resharded one, one
    reduce-scatter per reduce bucket; no eager collective; no unsharded
    parameter of a resharded unit saved for backward."""
    for res in run_distributed(_single_rank, 2, case, "aot_eager"):
        assert_close(res, 0.0)
        assert res["graphs"] == (1, 1) and res["unique_graphs"] == 1
        assert res["counts"] == [{}] * 3
        gathers = [b for b in res["buckets"] if b[0] == "gather"]
        resharded = sum(1 for b in gathers if b[1])
        reduces = sum(1 for b in res["buckets"] if b[0] == "reduce")
        assert res["fw"] == (len(gathers), 0, resharded)
        # Re-gathered in backward: each resharded unit whose backward reads its
        # weights (an embedding's backward needs only the indices).
        bw_gathers = res["bw"][0]
        assert bw_gathers <= resharded and res["bw"][1] == reduces
        assert res["saved_gathered"] == []
        for step in res["graph_counts"]:
            assert step == {"fw_all_gather": len(gathers), "bw_all_gather": bw_gathers,
                            "bw_reduce_scatter": reduces}
        (root,) = res["after"][-1]
        assert root[:2] == ("", "compiled") and len(root[2]) == len(res["units"])
        if case == "gpt":
            assert [m for m, _ in res["units"]] == GPT_UNITS
            assert [r for _, r in res["units"]] == [True] * 3 + [False]
            # 4 gathers; the two blocks are gathered again in backward (the
            # embeddings' backward reads no weight).
            assert len(gathers) == 4 and resharded == 3 and bw_gathers == 2
        if case == "tied":  # the tied embedding's unit is used last: kept
            assert res["units"][0] == (("embed", "<compiled module> (own reads)"), False)
            assert all(r for _, r in res["units"][1:])
        if case == "twice":  # ``shared`` is called twice: one unit, gathered once
            assert [m for m, _ in res["units"]] == [("pre",), ("shared",), ("frozen",), ("out",)]


def test_single_call_inductor() -> None:
    """The GPT's units under Inductor (those of "tied" and "twice": aot_eager, bitwise)."""
    for res in run_distributed(_single_rank, 2, "gpt", "inductor", timeout=900):
        assert_close(res, 1e-5)
        assert res["counts"] == [{}] * 3 and res["unique_graphs"] == 1
        assert [m for m, _ in res["units"]] == GPT_UNITS


def _eager_rank(rank: int, world: int) -> dict:
    build, make_batch, loss = gpt_case(False)
    res = run_parity(rank, build, fully_shard, make_batch, loss, steps=2,
                     after_step=lambda m: [(r.fqn, r.path, r.units) for r in explain(m)])
    return res


def test_single_call_eager_is_one_bucket_and_says_so() -> None:
    """Without compile the eager runtime gathers the whole application at once
    (documented); ``explain()`` says so."""
    for res in run_distributed(_eager_rank, 2):
        assert_close(res, 0.0)
        assert res["counts"][-1] == {"all_gather": 1, "reduce_scatter": 1}
        ((fqn, path, units),) = res["after"][-1]
        assert path == "eager" and len(units) == 1 and "the whole module" in units[0]
