"""Graph dumps of a 2-rank compiled run: every file, a valid Perfetto trace, and
a dump that survives a depyf failure and ``torch._dynamo.reset()``."""
from __future__ import annotations

import json
import os

import pytest
import torch

from compiled_fsdp import dump_graphs, fully_shard

from _dist import run_distributed
from _graphs import one_graph
from _models import gpt_case

GRAPH_FILES = [
    "01_dynamo_graph.py", "02_bytecode_decompiled.py", "10_joint_before_passes.py",
    "11_joint_after_lowering.py", "12_joint_after_recompute.py", "20_forward.py", "21_backward.py",
    "40_timeline.json", "50_pass_reports.txt",
]
INDUCTOR_FILES = ["30_inductor_forward.py", "31_inductor_backward.py"]


def _train(backend: str, reset_before_compile: bool = False) -> None:
    build, make_batch, loss_fn = gpt_case(False)
    model = build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    if reset_before_compile:
        torch._dynamo.reset()
    step = torch.compile(model, backend=backend)
    for i in range(2):
        inputs = make_batch(i)
        loss_fn(step(*inputs), *inputs).backward()


def _env_rank(rank: int, world: int, root: str, backend: str) -> None:
    one_graph()  # (its structure: tests/_graphs.py)
    os.environ["COMPILED_FSDP_DUMP"] = root  # read at the first fully_shard
    _train(backend)


def _reset_rank(rank: int, world: int, root: str, use_env: bool) -> None:
    """A user's torch._dynamo.reset() before compiling, and again between two
    compiled runs (notebooks and test suites do both)."""
    if use_env:
        os.environ["COMPILED_FSDP_DUMP"] = root
        torch._dynamo.reset()
        _train("aot_eager", reset_before_compile=True)
        torch._dynamo.reset()
        _train("aot_eager")
    else:
        with dump_graphs(root):
            torch._dynamo.reset()
            _train("aot_eager")
            torch._dynamo.reset()
            _train("aot_eager")


def _broken_depyf_rank(rank: int, world: int, root: str) -> bool:
    import depyf

    def broken(code):  # noqa: ANN001, ANN202
        raise depyf.decompiler.DecompilationError("forced by the test")

    depyf.decompile = broken  # this child process only
    def caches() -> tuple[bool, bool]:
        return torch._functorch.config.enable_autograd_cache, torch._inductor.config.fx_graph_cache

    before = caches()
    with dump_graphs(root):
        assert caches() == (False, False)
        _train("aot_eager")
    return caches() == before


def _no_depyf_rank(rank: int, world: int, root: str) -> float:
    """Training and the dump without depyf installed (an import of it fails)."""
    import sys

    sys.modules["depyf"] = None  # type: ignore[assignment]  # `import depyf` raises ImportError
    with dump_graphs(root):
        _train("aot_eager")
    return 0.0


def _graph_dir(root: str, rank: int) -> str:
    rank_dir = os.path.join(root, f"rank{rank}")
    graphs = sorted(d for d in os.listdir(rank_dir) if d.startswith("graph_"))
    assert graphs == ["graph_0_0"], graphs  # fullgraph model: one graph, no break
    return os.path.join(rank_dir, graphs[0])


def _check_trace(path: str) -> None:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "communication"} <= tracks.keys()
    slices = [e for e in events if e["ph"] == "X"]
    comm = [e for e in slices if e["tid"] == tracks["communication"]]
    assert any("all-gather" in e["name"] for e in comm) and any("reduce-scatter" in e["name"] for e in comm)
    assert any(e["tid"] == tracks["compute"] for e in slices)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)


@pytest.mark.parametrize("backend", ["inductor"])
def test_env_dump_has_every_file(tmp_path, backend: str) -> None:
    root = str(tmp_path / "dump")
    run_distributed(_env_rank, 2, root, backend, timeout=600)
    assert os.path.exists(os.path.join(root, "README.md"))
    for rank in range(2):
        gdir = _graph_dir(root, rank)
        for name in GRAPH_FILES + INDUCTOR_FILES:
            assert os.path.getsize(os.path.join(gdir, name)) > 0, name
        _check_trace(os.path.join(gdir, "40_timeline.json"))
        index = open(os.path.join(root, f"rank{rank}", "index.md")).read()
        assert "graph 0/0" in index and "collectives per step:" in index, index
        assert "all-gather" in index and "reduce-scatter" in index, index
        assert "0 graph breaks" in index and "FAILED" not in index
        # The units (see [Note: Units]): the root's leftovers cut in two, the
        # nested blocks whole; sizes, and the unit kept for backward.
        assert "unit 0: embed, <compiled module> (own reads)" in index, index
        assert "unit 1: norm, head" in index and "kept from forward to backward" in index, index
        assert "unit 0: layers.1" in index and "KiB unsharded" in index, index
        for name in GRAPH_FILES + INDUCTOR_FILES:
            assert name in index
        # (gloo's all-gather: [Note: All-gathers on gloo] in compiled_fsdp/core/comm.py)
        assert "all_gather_by_work" in open(os.path.join(gdir, "21_backward.py")).read()
        # the scheduling pass's partitioned graphs, each under its own name
        assert {"13_forward_after_schedule.py", "14_backward_after_schedule.py"} <= set(os.listdir(gdir))


@pytest.mark.parametrize("use_env", [True, False])
def test_dump_survives_dynamo_reset(tmp_path, use_env: bool) -> None:
    """See [Note: Dumps survive a reset]: both runs' graphs are written, the
    second under its own prefix, and the index lists both."""
    root = str(tmp_path / "dump")
    run_distributed(_reset_rank, 2, root, use_env, timeout=600)
    for rank in range(2):
        rank_dir = os.path.join(root, f"rank{rank}")
        graphs = sorted(d for d in os.listdir(rank_dir) if d.startswith("graph_"))
        assert graphs == ["graph_0_0", "graph_r1_0_0"], graphs
        for g in graphs:
            for name in GRAPH_FILES:
                assert os.path.getsize(os.path.join(rank_dir, g, name)) > 0, (g, name)
        index = open(os.path.join(rank_dir, "index.md")).read()
        assert "graph 0/0" in index and "graph r1:0/0" in index, index


def test_depyf_failure_keeps_everything_else(tmp_path) -> None:
    root = str(tmp_path / "dump")
    assert run_distributed(_broken_depyf_rank, 2, root) == [True, True]  # config restored
    for rank in range(2):
        gdir = _graph_dir(root, rank)
        for name in GRAPH_FILES:
            if name != "02_bytecode_decompiled.py":
                assert os.path.getsize(os.path.join(gdir, name)) > 0, name
        assert not os.path.exists(os.path.join(gdir, "02_bytecode_decompiled.py"))
        index = open(os.path.join(root, f"rank{rank}", "index.md")).read()
        assert "FAILED" in index and "DecompilationError: forced by the test" in index


def test_dump_without_depyf_says_what_to_install(tmp_path) -> None:
    """depyf is optional (the ``debug`` extra): without it training and every
    other dump file work, and the bytecode file says what to install."""
    root = str(tmp_path / "dump")
    run_distributed(_no_depyf_rank, 2, root)
    for rank in range(2):
        gdir = _graph_dir(root, rank)
        for name in GRAPH_FILES:
            assert os.path.getsize(os.path.join(gdir, name)) > 0, name
        text = open(os.path.join(gdir, "02_bytecode_decompiled.py")).read()
        assert "depyf is not installed" in text and "pip install depyf" in text, text
        assert "FAILED" not in open(os.path.join(root, f"rank{rank}", "index.md")).read()


def _two_kinds_rank(rank: int, world: int, root: str) -> None:
    """The embedding sharded on its own too, as torchtitan does: a region of
    another class, which torch partitions after the blocks' (in backward's
    order) and the root calls first."""
    build, make_batch, loss_fn = gpt_case(False)
    model = build()
    fully_shard(model.embed)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    step = torch.compile(model, backend="aot_eager")
    with dump_graphs(root):
        for i in range(2):
            inputs = make_batch(i)
            loss_fn(step(*inputs), *inputs).backward()


def _regions_rank(rank: int, world: int, root: str) -> None:
    with dump_graphs(root):
        _train("aot_eager")  # (compile regions: the default)


def _comm_slices(path: str) -> list[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return [e["name"] for e in events if e["ph"] == "X" and e["tid"] == tracks["communication"]]


def test_dump_of_compile_regions(tmp_path) -> None:
    """[Note: A region's graphs in a dump]: the blocks' region gets a folder
    of its own beside the root's graph (its joint graph before and after the
    passes, its timeline with its gathers and reduce on the communication
    track, its reports), and the index says how often the root calls it and
    what it holds; the root's files stay the root's."""
    root = str(tmp_path / "dump")
    run_distributed(_regions_rank, 2, root, timeout=600)
    for rank in range(2):
        gdir = _graph_dir(root, rank)
        rdir = os.path.join(gdir, "region_0")
        assert sorted(d for d in os.listdir(gdir) if d.startswith("region_")) == ["region_0"]
        for name in ["10_joint_before_passes.py", "11_joint_after_lowering.py", "12_joint_after_recompute.py",
                     "13_forward_after_partition.py", "14_backward_after_partition.py", "40_timeline.json",
                     "50_pass_reports.txt"]:
            assert os.path.getsize(os.path.join(rdir, name)) > 0, name
        # the root's joint graph calls the region; the region's is the block's own
        assert "invoke_subgraph" in open(os.path.join(gdir, "12_joint_after_recompute.py")).read()
        assert "invoke_subgraph" not in open(os.path.join(rdir, "12_joint_after_recompute.py")).read()
        # [Note: Collectives inside an op]: the region's gather and reduce, the root's gathers issued ahead
        region_comm, root_comm = _comm_slices(os.path.join(rdir, "40_timeline.json")), _comm_slices(
            os.path.join(gdir, "40_timeline.json"))
        assert any(s.startswith("all-gather (regather") for s in region_comm), region_comm
        assert any(s.startswith("reduce-scatter waited after the graph") for s in region_comm), region_comm
        assert sum(s.startswith("all-gather issued ahead for a region") for s in root_comm) == 2, root_comm
        index = open(os.path.join(root, f"rank{rank}", "index.md")).read()
        assert "0 graph breaks; 1 compile region(s), below" in index, index
        assert "**0/0 region 0**: a compile region's body, called 2 time(s) a step" in index, index
        assert "    - unit 0: layers.0," in index and "`graph_0_0/region_0/40_timeline.json`" in index, index
        assert "2 all-gather (regather" in index and "1 reduce-scatter waited after the graph" in index, index


def test_dump_of_two_kinds_of_region(tmp_path) -> None:
    """Each region's calls are its own, whatever order torch partitions them in."""
    root = str(tmp_path / "dump")
    run_distributed(_two_kinds_rank, 2, root, timeout=600)
    for rank in range(2):
        index = open(os.path.join(root, f"rank{rank}", "index.md")).read()
        regions = [line for line in index.splitlines() if "compile region's body" in line]
        units = [line for line in index.splitlines() if line.startswith("    - unit 0:")]
        assert len(regions) == 2 and len(units) == 2, index
        calls = {u.split(":")[1].split(",")[0].strip(): r.split("called ")[1].split(" time")[0]
                 for r, u in zip(regions, units)}
        assert calls == {"layers.0": "2", "embed": "1"}, index


def test_graphs_of_compile_regions_find_their_region(tmp_path) -> None:
    """[Note: A region's graphs in a dump], on hand-built graphs: a region's
    joint graph opens its record and its partitioned graphs follow it; the
    root's calls are counted by the forward graph the partitioner returned,
    whatever the order the regions came in; a scheduled graph that calls no
    region, in a compile with regions, is left out."""
    from compiled_fsdp.tools.debug import _graph_of
    from compiled_fsdp.tools.debug_render import GraphRecord, count_region_calls

    def graph(**calls: int) -> torch.fx.GraphModule:
        root, g = torch.nn.Module(), torch.fx.Graph()
        x = g.placeholder("x")
        for name, n in calls.items():
            setattr(root, name, torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
            for _ in range(n):
                body = g.get_attr(name)
                g.call_function(torch.ops.higher_order.invoke_subgraph, (body, f"partitioned_{name}", x))
        g.output(x)
        return torch.fx.GraphModule(root, g)

    root = graph(fw_subgraph_1=1, fw_subgraph_0=3, bw_subgraph_0=3)  # (the embedding's called first)
    rec = GraphRecord("0/0", str(tmp_path))
    blocks = _graph_of(rec, "before", "joint", graph(), region=True)  # (partitioned first)
    assert _graph_of(rec, "lowering", "joint", graph(), region=True) is blocks
    assert _graph_of(rec, "partition", "forward", root.fw_subgraph_0, region=True) is blocks
    assert _graph_of(rec, "partition", "backward", root.bw_subgraph_0, region=True) is blocks
    embed = _graph_of(rec, "before", "joint", graph(), region=True)
    assert _graph_of(rec, "partition", "forward", root.fw_subgraph_1, region=True) is embed
    assert rec.regions == [blocks, embed] and blocks.region and blocks.dir.endswith("region_0")
    count_region_calls(rec, root)
    assert (blocks.calls, embed.calls) == (3, 1)
    assert _graph_of(rec, "schedule", "forward", root, region=False) is rec
    assert _graph_of(rec, "schedule", "forward", graph(), region=False) is None
    assert _graph_of(GraphRecord("0/1", str(tmp_path)), "schedule", "forward", graph(), region=False) is not None


def test_a_backward_regather_drawn_once() -> None:
    """[Note: Collectives inside an op]: a handed-in module's backward
    ``regather`` sits in the joint graph's forward, tagged to run in backward
    only; the dump's timeline draws it once, in backward where it runs, and
    none over a shard group of one rank."""
    from torch.utils.checkpoint import CheckpointPolicy

    from compiled_fsdp.passes.cost_model import CostModel
    from compiled_fsdp.passes.graph import META_KEY, ChainTag
    from compiled_fsdp.passes.timeline import REGATHER, simulate

    def joint(world: int) -> torch.fx.Graph:
        g = torch.fx.Graph()
        shard, tangent = g.placeholder("primals_1"), g.placeholder("tangents_1")
        shard.meta["val"], tangent.meta["val"] = torch.empty(16 // world), torch.empty(16)
        again = g.call_function(REGATHER, ([shard], [16], "0", world, -1, None), {"backward": True})
        again.meta.update({"val": torch.empty(16), "recompute": CheckpointPolicy.MUST_RECOMPUTE,
                           "partitioner_tag": "must_be_in_backward",
                           META_KEY: ChainTag("gather_chain", -1, 0, ((-1, 0),), True)})
        grad = g.call_function(torch.ops.aten.mul.Tensor, (tangent, again))
        grad.meta["val"] = torch.empty(16)
        g.output(grad)
        return g

    g = joint(2)
    tl = simulate(list(g.nodes), CostModel.for_graph(g), joint=True, foreign=True)
    comm = [s for s in tl.steps if s.track == "communication"]
    assert [(s.kind, s.regather) for s in comm] == [("all_gather", True)], tl.steps
    (forward,) = [p for p in tl.phases if p[0] == "forward"] or [("forward", 0.0, 0.0)]
    assert all(s.start_s >= forward[2] for s in comm), (tl.phases, comm)
    # over a shard group of one rank it gathers nothing: none drawn (and the re-gather's wait finds none)
    g = joint(1)
    tl = simulate(list(g.nodes), CostModel.for_graph(g), joint=True, foreign=True)
    assert not [s for s in tl.steps if s.track == "communication"], tl.steps
