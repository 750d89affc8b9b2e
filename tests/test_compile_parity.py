"""The compile path: numerics against the reference and the eager runtime, and the
structure of the compiled graphs."""
from __future__ import annotations

import pytest
import torch

from compiled_fsdp import fully_shard
from compiled_fsdp.core import compat

from _dist import run_distributed
from _graphs import AG, MARKER_OPS, GraphCapture, count, count_reduces, one_graph, resharded_gathers, saved_gathered
from _models import gpt_case
from _parity import assert_close, run_parity


def _shard(reshard: bool):
    def shard(model):
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)

    return shard


def _parity_rank(rank: int, world: int, backend: str, reshard: bool, tied: bool) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    build, make_batch, loss = gpt_case(tied)
    capture = GraphCapture() if backend == "aot_eager" else None
    res = run_parity(
        rank, build, _shard(reshard), make_batch, loss,
        wrap=lambda m: torch.compile(
            m, backend=capture.backend if capture else backend, fullgraph=True),
        after_step=lambda m: [p.to_local().shape[0] for p in m.parameters()],
    )
    if capture is not None:  # the ops each rank's compiled graphs run, in order
        res["ops"] = [str(n.target) for g in capture.forward + capture.backward
                      for n in g.graph.nodes if n.op == "call_function"]
    return res


@pytest.mark.parametrize(
    "world,reshard,tied",
    [(2, True, False), (2, False, True), (3, True, True)],
)
def test_aot_eager_parity(world: int, reshard: bool, tied: bool) -> None:
    """aot_eager is bitwise equal to the reference on 2 ranks (and so to the eager
    runtime, which is bitwise too); on 3 ranks within 1e-6. No eager collective,
    no marker left. The tied cases have a 67-row embedding, so ranks hold different
    numbers of rows (3 ranks: 23, 23, 21), and still every rank's graphs run the
    same ops in the same order (see [Note: Rank-independent graphs])."""
    results = run_distributed(_parity_rank, world, "aot_eager", reshard, tied)
    for res in results:
        assert_close(res, 0.0 if world == 2 else 1e-6)
        assert res["counts"] == [{}] * 3
        assert not MARKER_OPS.intersection(res["ops"])
    assert all(res["ops"] == results[0]["ops"] for res in results)
    if tied and world == 3:
        assert len({tuple(res["after"][0]) for res in results}) > 1


def test_markers_run_eagerly_without_passes() -> None:
    """backend="eager" runs Dynamo's graph without AOTAutograd, so no pass lowers
    the markers: their own per-parameter collectives must still train exactly."""
    for res in run_distributed(_parity_rank, 2, "eager", True, True):
        assert_close(res, 0.0)
        # One gather and one reduce-scatter per parameter read: autograd keeps
        # the gathered values for backward, so nothing is re-gathered.
        for c in res["counts"]:
            assert c == {"unbucketed_all_gather": c["unbucketed_all_gather"],
                         "unbucketed_reduce_scatter": c["unbucketed_reduce_scatter"]}
            assert c["unbucketed_all_gather"] == c["unbucketed_reduce_scatter"] > 3


def test_inductor_parity() -> None:
    """Inductor (the default backend) fuses and reorders float math: tight tolerance."""
    for res in run_distributed(_parity_rank, 2, "inductor", True, False, timeout=900):
        assert_close(res, 1e-5)
        assert res["counts"] == [{}] * 3


def _cached_rank(rank: int, world: int, cache_dir: str, blocks: bool) -> dict:
    import os

    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._functorch.config.enable_autograd_cache = True
    torch._inductor.config.fx_graph_cache = True
    if blocks:  # each block compiled on its own, the root eager (torchtitan's pattern)
        build, make_batch, loss = gpt_case(False)

        def compile_blocks(m: torch.nn.Module) -> torch.nn.Module:
            for block in m.layers:
                block.compile(fullgraph=True)
            return m

        res = run_parity(rank, build, _shard(True), make_batch, loss, steps=2, wrap=compile_blocks)
    else:
        def build() -> torch.nn.Module:
            torch.manual_seed(0)  # 5 and 3 rows: ranks hold 3 and 2, 2 and 1
            return torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

        def make_batch(step: int) -> tuple:
            return (torch.randn(4, 8, generator=torch.Generator().manual_seed(step)),)

        res = run_parity(
            rank, build, fully_shard, make_batch, lambda out, x: out.square().mean(), steps=2,
            wrap=lambda m: torch.compile(m, fullgraph=True),
        )
    res["cache"] = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                    if k.startswith(("fxgraph_cache_", "autograd_cache_")) and not k.endswith("_saved")}
    return res


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
def test_a_second_job_hits_the_caches(tmp_path, blocks: bool) -> None:
    """A job started again unchanged (Inductor's and AOTAutograd's caches on,
    one cache directory, as every job on a host shares one) compiles nothing:
    every graph is a hit, and it trains as the first did. Nothing in what the
    passes emit (a name, an id, a dict order) may change the cache key from
    one process to the next (see [Note: AOTAutograd cache]). ``whole``: ranks
    holding different numbers of rows compile different graphs, and each
    rank loads its own (see [Note: Local rows in the marker]). ``blocks``:
    one block graph shared by every block and the stand-in's handoff
    ([Note: A stand-in for the last block's next])."""
    runs = [run_distributed(_cached_rank, 2, str(tmp_path), blocks, timeout=600) for _ in range(2)]
    for results in runs:
        for res in results:
            assert_close(res, 1e-5)
            # (blocks: the eager root's own gather and reduction each step)
            assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 2} if blocks else {}] * 2
    # (one training graph: a forward and a backward kernel module; on torch
    # 2.11 AOTAutograd's cache is bypassed: see compat.aot_cache_takes_to_local)
    aot = "autograd_cache_{}" if compat.aot_cache_takes_to_local() else "autograd_cache_bypass"
    for first, second in zip(*runs):
        assert first["cache"] == {aot.format("miss"): 1, "fxgraph_cache_miss": 2}, first["cache"]
        assert second["cache"] == {aot.format("hit"): 1, "fxgraph_cache_hit": 2}, second["cache"]
        assert (first["loss"], first["param"]) == (second["loss"], second["param"])


def _inference_rank(rank: int, world: int, backend: str, blocks: bool) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    import copy

    import compiled_fsdp
    from compiled_fsdp.compile.install import recording
    from compiled_fsdp.tools.check_worker import max_diff

    # A cache hit skips the passes (see [Note: AOTAutograd cache]): no report.
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    build, make_batch, _ = gpt_case(False)
    ref = build()
    model = copy.deepcopy(ref)
    _shard(True)(model)
    if blocks:  # each block on its own, the root eager; see tests/test_block_compile.py
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
    runner = model if blocks else torch.compile(model, backend=backend, fullgraph=True)
    out = []
    with recording() as rec:
        for step in range(2):
            (tokens,) = make_batch(step)
            compiled_fsdp.reset_collective_counts()
            with torch.no_grad():
                logits = runner(tokens)
            out.append((max_diff(logits, ref(tokens)), compiled_fsdp.collective_counts()))
    return {"steps": out, "gather_buckets": [r.lowering.count("gather") for r in rec.joint],
            "handoffs": [sorted(r.lowering.handoffs) for r in rec.joint],
            "params": len(list(ref.parameters()))}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_no_grad_inference(backend: str) -> None:
    """A frame compiled under ``no_grad`` is an inference graph, which the joint
    pass never sees (see [Note: Inference graphs]). Inductor lowers its markers
    in the post-grad pass: one bucketed all-gather per unit and no eager
    collective; aot_eager runs them unbucketed. Both match the reference."""
    for res in run_distributed(_inference_rank, 2, backend, False, timeout=900):
        for diff, counts in res["steps"]:
            if backend == "inductor":
                assert diff <= 1e-5 and counts == {}
            else:
                assert diff == 0.0 and counts == {"unbucketed_all_gather": res["params"]}
        # 2 blocks, and the root's units: embed + pos, head (norm joins layers.1)
        assert res["gather_buckets"] == ([4] if backend == "inductor" else [])


def _structure_rank(rank: int, world: int, reshard: bool, opening: bool | None = None) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    from torch._dynamo.utils import counters

    from compiled_fsdp.passes.config import overlap

    if opening is not None:  # (nothing merged, so that the tiny first block's parts are units)
        overlap.bucket_bytes, overlap.split_opening = 0, opening

    torch._dynamo.reset()
    counters.clear()
    build, make_batch, loss = gpt_case(False)
    capture = GraphCapture()
    res = run_parity(
        rank, build, _shard(reshard), make_batch, loss, steps=5,
        wrap=lambda m: torch.compile(m, backend=capture.backend, fullgraph=True),
    )
    fw, bw = capture.forward, capture.backward
    return {
        "graphs": (len(fw), len(bw)),
        "breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "fw_gathers": count(fw[0], AG),
        "bw_gathers": count(bw[0], AG),
        "fw_reduces": count_reduces(fw[0]),
        "bw_reduces": count_reduces(bw[0]),
        "resharded_gathers": len(resharded_gathers(fw[0])),
        "saved_gathered": saved_gathered(fw[0]),
        "marker_left": any(str(n.target) in MARKER_OPS for g in fw + bw for n in g.graph.nodes),
        "counts": res["counts"],
        "param": res["param"], "loss": res["loss"], "grad": res["grad"],
    }


def test_the_opening_block_cut_on_ranks() -> None:
    """[Note: The step's opening block cut by first use]: with nothing merged,
    one graph gathers and reduces the first block's parts apart (the second
    block whole), bitwise equal to the reference; with the setting off, one
    collective each way for the block."""
    off, on = (run_distributed(_structure_rank, 2, True, opening)[0] for opening in (False, True))
    for res in (off, on):
        assert_close(res, 0.0)
        assert res["graphs"] == (1, 1) and res["breaks"] == 0
    more = on["fw_gathers"] - off["fw_gathers"]
    assert more >= 1, (on["fw_gathers"], off["fw_gathers"])
    assert on["bw_reduces"] - off["bw_reduces"] == more
    assert on["bw_gathers"] - off["bw_gathers"] == more  # (the block's weights read again in backward)


@pytest.mark.parametrize("reshard", [True, False])
def test_fullgraph_structure(reshard: bool) -> None:
    for res in run_distributed(_structure_rank, 2, reshard):
        # One forward and one backward graph over 5 steps: no break, no recompile.
        assert res["graphs"] == (1, 1) and res["breaks"] == 0 and res["unique_graphs"] == 1
        # One bucketed all-gather per unit: the 2 blocks the user nested, and the
        # root's leftovers cut into units (see [Note: Units]): embed + pos, and
        # head (norm is small and joins layers.1's bucket) ...
        assert res["fw_gathers"] == 4 and res["fw_reduces"] == 0
        # ... resharded but the head's (used last), re-gathered in backward
        # where backward reads the weights (not the embedding's) ...
        assert res["resharded_gathers"] == (3 if reshard else 0)
        assert res["bw_gathers"] == (2 if reshard else 0)
        # ... and one reduce-scatter per unit.
        assert res["bw_reduces"] == 4
        # No unsharded parameter of a resharding unit is saved for backward.
        assert res["saved_gathered"] == []
        assert not res["marker_left"]
        assert res["counts"] == [{}] * 5
        assert max(res["param"]) == 0.0


def _twice_rank(rank: int, world: int) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    from _models import Twice, twice_batch, twice_loss

    torch._dynamo.reset()
    capture = GraphCapture()

    def shard(model):
        for m in (model.pre, model.shared, model.frozen, model.spare):
            fully_shard(m)
        fully_shard(model)

    res = run_parity(
        rank, Twice, shard, twice_batch, twice_loss,
        wrap=lambda m: torch.compile(m, backend=capture.backend, fullgraph=True),
        graph_counts=capture.take_runtime,
    )
    res["graphs"] = (len(capture.forward), len(capture.backward))
    return res


def test_compiled_module_called_twice_frozen_unused() -> None:
    """Compiled: a module called twice is gathered once (its two reads share one
    bucket) and reduced once (gradients of both uses summed first); a frozen
    module is gathered but never reduced; a module never called is never gathered."""
    for res in run_distributed(_twice_rank, 2):
        assert_close(res, 0.0)
        assert res["graphs"] == (1, 1) and res["counts"] == [{}] * 3
        for step in res["graph_counts"]:
            assert step["fw_all_gather"] == 4  # pre, shared, frozen, root
            assert step["bw_reduce_scatter"] == 3  # pre, shared, root


def test_no_grad_inference_blocks() -> None:
    """The same with each block compiled on its own and the root eager (see
    [Note: Gathers handed to the next block's graph]), under Inductor: the
    root gathers its own parameters and hands layers.0 its gather (2 eager
    all-gathers), layers.0's inference graph hands layers.1 its gather,
    lowered by the post-grad pass. Matches the reference. (Under aot_eager
    the handoff ops' own implementations run: tests/test_handoff.py.)"""
    for res in run_distributed(_inference_rank, 2, "inductor", True, timeout=900):
        for diff, counts in res["steps"]:
            assert diff <= 1e-5 and counts == {"all_gather": 2}
        # one graph: the last block hands its gather to a stand-in
        assert res["handoffs"] == [["issue", "read"]] and res["gather_buckets"] == [0]
