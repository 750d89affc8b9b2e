"""The trap other libraries fall into: compiling before sharding must not
silently train unsharded. Both orders below shard for real and match the reference."""
from __future__ import annotations

import pytest
import torch

from compiled_fsdp import explain, fully_shard

from _dist import run_distributed
from _models import gpt_case
from _parity import assert_close, run_parity


def _rank(rank: int, world: int, scenario: str) -> dict:
    torch._dynamo.reset()
    build, make_batch, loss = gpt_case(False)
    compiled = {}

    def shard(model):
        if scenario == "blocks_compiled_first":
            # Blocks replaced by their torch.compile wrappers, then sharded.
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block, backend="aot_eager")
            for block in model.layers:
                fully_shard(block)
        else:
            # The whole model compiled and run unsharded first, then sharded.
            compiled["model"] = torch.compile(model, backend="aot_eager")
            toks = make_batch(99)[0]
            compiled["model"](toks).sum().backward()
            model.zero_grad(set_to_none=True)
            for block in model.layers:
                fully_shard(block)
        fully_shard(model)

    def wrap(model):
        return compiled.get("model", model)

    res = run_parity(rank, build, shard, make_batch, loss, wrap=wrap,
                     after_step=lambda m: [(r.fqn, r.path) for r in explain(m)])
    return res


@pytest.mark.parametrize("scenario", ["blocks_compiled_first", "model_compiled_and_run_first"])
def test_compile_before_fully_shard_still_shards(scenario: str) -> None:
    for res in run_distributed(_rank, 2, scenario):
        assert_close(res, 0.0)
        # Communication happened every step: the model really is sharded. Blocks
        # compiled on their own gather and reduce in their graphs; the root runs
        # eagerly (all-gather and reduce-scatter for itself and for the first
        # block, whose gather it hands over). See [Note: Blocks compiled on their
        # own] and tests/test_block_compile.py.
        if scenario == "blocks_compiled_first":
            assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 2}] * 3
            assert res["after"][-1] == [("", "eager"), ("layers.0", "compiled"), ("layers.1", "compiled")]
        else:
            assert res["counts"] == [{}] * 3
