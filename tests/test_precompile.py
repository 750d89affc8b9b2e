"""A second job loads its whole-model traces with torch's caching precompile
(``torch._dynamo.config.caching_precompile``, ``TORCH_CACHING_PRECOMPILE=1``)
instead of tracing again. See [Note: Generated classes by reference] in
compiled_fsdp/runtime/generated.py."""
from __future__ import annotations

import pickle

import pytest
import torch

from compiled_fsdp import fully_shard
from compiled_fsdp.core import compat

from _dist import run_distributed
from _models import gpt_case
from _parity import assert_close, run_parity


def _shard(model: torch.nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def _job_rank(rank: int, world: int, cache_dir: str, save: bool, per_rank: bool) -> dict:
    import os

    from torch._dynamo.utils import compilation_time_metrics, counters

    import compiled_fsdp

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}") if per_rank else cache_dir
    torch.set_num_threads(1)  # (the two jobs' kernels bitwise alike)
    torch._dynamo.config.caching_precompile = True
    torch._functorch.config.enable_autograd_cache = True
    torch._inductor.config.fx_graph_cache = True
    build, make_batch, loss = gpt_case(False)
    models = []

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        models.append(model)
        return torch.compile(model, fullgraph=True)

    res = run_parity(rank, build, _shard, make_batch, loss, steps=3, wrap=wrap,
                     after_step=lambda m: [p.detach().to_local().clone() for p in m.parameters()])
    if save:
        torch.compiler.save_cache_artifacts()
    res["traced_s"] = sum(compilation_time_metrics.get("bytecode_tracing", []))
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["paths"] = [r.path for r in compiled_fsdp.explain(models[0])]
    res["regions"] = [any("compile region" in u for u in r.units) for r in compiled_fsdp.explain(models[0])]
    return res


LOADS = pytest.mark.skipif(not compat.saved_traces_load(), reason="this torch cannot load a saved trace of a "
                           "sharded model (compat.saved_traces_load): see the refusal test")


@LOADS
@pytest.mark.parametrize("per_rank", [False, True], ids=["shared", "per_rank"])
def test_a_second_job_loads_its_traces(tmp_path, per_rank: bool) -> None:
    """The first job traces its whole model (compile regions) and saves
    Dynamo's traces with ``torch.compiler.save_cache_artifacts()``; the
    second, sharded alike, loads them: Dynamo traces nothing, every module
    runs compiled (no eager collective), and it trains bitwise as the first
    did, both within 1e-5 of the single-process reference (Inductor). Its
    ranks hold different numbers of rows (67 embedding rows), so their
    guards differ: with one cache directory (``shared``, as on one host)
    torch keeps the trace of the rank that saved last, which that rank
    loads while the other traces again, and trains alike, with no false
    divergence error ([Note: Agreeing on collectives]: no GRAPH check); with
    a directory a rank (``per_rank``) every rank loads. Fails where a
    generated class pickles by name (the first job's traces are not saved:
    "package bypass") or an op a loaded graph calls is not defined yet."""
    first, second = (run_distributed(_job_rank, 2, str(tmp_path), save, per_rank, timeout=900)
                     for save in (True, False))
    for a, b in zip(first, second):
        for res in (a, b):
            assert_close(res, 1e-5)
            assert res["counts"] == [{}] * 3, res["counts"]
            assert set(res["paths"]) == {"compiled"} and res["regions"] == [False, True, True], res
        assert a["traced_s"] > 0 and a["graphs"] > 0, a
        for step_a, step_b in zip(a["after"], b["after"]):
            assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    loaded = [b["traced_s"] == 0 and b["graphs"] == 0 for b in second]
    assert all(loaded) if per_rank else any(loaded), [(b["traced_s"], b["graphs"]) for b in second]


@LOADS
def test_generated_classes_pickle_by_what_they_are_made_of() -> None:
    """A class ``fully_shard`` made pickles as its key and loads as the same
    class in the process that made it, or fails to load, saying what to do,
    in one that made none from that key; a sharded module's instance pickles
    as itself (``FSDPModule.__new__`` would make a plain module anew)."""
    from compiled_fsdp import FSDPModule
    from compiled_fsdp.runtime import generated
    from compiled_fsdp.runtime.registry import RUNTIME

    key = ("test", torch.nn.Sequential, ("x",))
    made = generated.make("FSDPSequential", (FSDPModule, torch.nn.Sequential),
                          {"_fsdp_base_class": torch.nn.Sequential}, key)
    try:
        assert pickle.loads(pickle.dumps(made)) is made and made.__name__ == made.__qualname__ == "FSDPSequential"
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        model.__class__ = made
        again = pickle.loads(pickle.dumps(model))
        assert type(again) is made and torch.equal(again[1].weight, model[1].weight)
    finally:
        del RUNTIME.generated[key]
    with pytest.raises(LookupError, match="fully_shard before the first compiled call"):
        pickle.loads(pickle.dumps(made))


def _blocks_rank(rank: int, world: int) -> str:
    torch._dynamo.config.caching_precompile = True
    build, make_batch, _ = gpt_case(False)
    model = build()
    _shard(model)
    for block in model.layers:
        block.compile(backend="aot_eager")
    try:
        model(*make_batch(0))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@LOADS
def test_blocks_compiled_on_their_own_refuse_caching_precompile() -> None:
    """A block compiled on its own (torchtitan's pattern) under caching
    precompile: its loaded trace would skip what the block's trace records
    for the runtime (the parameters its graph reads, the gather it hands to
    the next block), and the second job would train wrong (measured: loss
    3e-3 off the reference after three steps, silently). So its first
    forward says so and what to do, on every rank, in the job that would
    save the traces already."""
    for message in run_distributed(_blocks_rank, 2):
        assert "compiled on its own" in message and "torch.compile(model)" in message, message


def _refused_rank(rank: int, world: int) -> str:
    torch._dynamo.config.caching_precompile = True
    try:
        _shard(gpt_case(False)[0]())
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.skipif(compat.saved_traces_load(), reason="this torch loads a saved trace of a sharded model")
def test_a_release_that_cannot_load_a_trace_refuses_caching_precompile() -> None:
    """Where torch fails to save or load a sharded model's traces (2.13:
    Dynamo raises on pickling the made classes, and on loading a trace once
    they pickle), ``fully_shard`` under caching precompile says so and what
    to do, on every rank, instead of the compile's error."""
    for message in run_distributed(_refused_rank, 2):
        assert "caching precompile" in message and "torch 2.15" in message, message
