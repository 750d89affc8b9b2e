"""Dynamic shapes: a sharded model compiled whole and fed batches of other
sizes, under automatic dynamic shapes (``dynamic=None``, the default) and
with every size dynamic (``torch.compile(dynamic=True)``). See [Note: Static
ints under dynamic=True] in compiled_fsdp/core/marker.py and [Note: No compile
regions under dynamic=True] in compiled_fsdp/compile/regions.py."""
from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch

import compiled_fsdp
from compiled_fsdp.tools.models import loss_fn
from examples.gpt import GPT, GPTConfig

from _dist import run_distributed
from _models import shard_each
from _parity import run_parity

# (batch, sequence) a step: the second step's new sizes recompile with symbolic ones
SIZES = [(2, 16), (2, 12), (3, 10), (1, 16)]


def _build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=67, dim=24, n_layers=3, n_heads=2, seq=16))


def _batch(step: int) -> tuple[torch.Tensor]:
    b, t = SIZES[step]
    return (torch.randint(0, 67, (b, t), generator=torch.Generator().manual_seed(step)),)


def _replicate_each(model: GPT) -> None:
    for block in model.layers:
        compiled_fsdp.replicate(block)
    compiled_fsdp.replicate(model)


def _rank(rank: int, world: int, regions: bool, dynamic: Optional[bool], shard: str = "fully_shard") -> dict:
    compiled_fsdp.config.comm.block_regions = regions
    compiled: list[torch.nn.Module] = []

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        compiled.append(model)
        return torch.compile(model, backend="aot_eager", dynamic=dynamic)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_parity(rank, _build, shard_each if shard == "fully_shard" else _replicate_each, _batch, loss_fn,
                         steps=len(SIZES), wrap=wrap)
    res["warnings"] = [str(w.message)[:200] for w in caught if "compiled_fsdp" in str(w.message)]
    report = {r.fqn: r for r in compiled_fsdp.explain(compiled[0])}
    res["block"] = (report["layers.0"].path, report["layers.0"].reason, report["layers.0"].units)
    return res


@pytest.mark.parametrize("regions,dynamic", [(False, True), (True, True), (True, None)],
                         ids=["one_graph-dynamic_true", "regions-dynamic_true", "regions-automatic"])
def test_dynamic_true_buckets_every_collective(regions: bool, dynamic: Optional[bool]) -> None:
    """Four steps of other batch and sequence sizes, compiled whole under
    ``aot_eager``: bitwise equal to the single-process reference, with no
    eager collective (every marker lowered into its bucket). Before [Note:
    Static ints under dynamic=True], ``dynamic=True`` left one graph with 38
    unbucketed all-gathers and reduce-scatters a step while ``explain`` said
    "compiled", and regions raised torch's "Freevar has no source" at the
    first step. Under ``dynamic=True`` a block is no region, and ``explain``
    says why; under automatic dynamic shapes it stays one."""
    for res in run_distributed(_rank, 2, regions, dynamic, timeout=900):
        assert res["loss"] == [0.0] * len(SIZES) and max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["counts"] == [{}] * len(SIZES), res["counts"]
        path, reason, units = res["block"]
        assert path == "compiled", res["block"]
        if regions and dynamic:
            assert reason is not None and "dynamic=True" in reason, res["block"]
        elif regions:
            assert reason is None and units[0].startswith("a compile region"), res["block"]


def test_replicate_under_dynamic_true() -> None:
    """``replicate`` (a shard group of one rank: DDP's layout) each block and
    the root, compiled whole with ``dynamic=True``: four steps of other
    sizes, bitwise to the reference, every all-reduce in its bucket, no
    warning. Before [Note: Static sizes in the reduce] (passes/_emit.py) the
    first backward raised ``NameError`` on a symbol (the head count's) that
    the backward graph does not bind; a special case of the lowering then
    left every reduce to its eager all-reduce (33 a step) with a warning."""
    for res in run_distributed(_rank, 2, True, True, "replicate", timeout=900):
        assert res["loss"] == [0.0] * len(SIZES) and max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["counts"] == [{}] * len(SIZES), res["counts"]
        assert res["warnings"] == [], res["warnings"]
