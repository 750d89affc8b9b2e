"""The torchtitan pattern: ``fully_shard`` per block and the root, then each block
compiled on its own (``block.compile()`` or ``torch.compile(block)`` in its
parent's place), the root running eagerly. Every block gathers and reduces in
its graphs, and the identical blocks share one compiled graph. See [Note: Blocks
compiled on their own] in compiled_fsdp/_param_group.py."""
from __future__ import annotations

import pytest
import torch

from compiled_fsdp import explain, fully_shard
from examples.gpt import GPT, GPTConfig
from _dist import run_distributed
from _graphs import GraphCapture
from _models import gpt_case
from _parity import assert_close, run_parity

N_BLOCKS = 4


def _deep() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=67, dim=24, n_layers=N_BLOCKS, n_heads=2, seq=16))


def _shard(model: GPT) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def _blocks_rank(rank: int, world: int, how: str, backend: str) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
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

    res = run_parity(rank, _deep, _shard, make_batch, loss, steps=3, wrap=wrap,
                     graph_counts=capture.take_runtime if capture is not None else None,
                     after_step=lambda m: [(r.fqn, r.path, r.units) for r in explain(m)])
    res["unique_graphs"] = counters["stats"]["unique_graphs"]
    res["recompiles"] = sum(counters["recompiles"].values())
    if capture is not None:
        res["graphs"] = (len(capture.forward), len(capture.backward))
    return res


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_blocks_share_one_graph_aot_eager(how: str) -> None:
    """Bitwise equal to the reference after 3 AdamW steps; the 4 identical
    blocks compile once (one Dynamo graph, one forward and one backward graph,
    no recompile); each block's forward graph runs one all-gather, its backward
    one re-gather and one reduce-scatter; the eager root communicates once each
    way."""
    for res in run_distributed(_blocks_rank, 2, how, "aot_eager", timeout=600):
        assert_close(res, 0.0)
        assert res["unique_graphs"] == 1 and res["recompiles"] == 0
        assert res["graphs"] == (1, 1)
        assert res["graph_counts"] == [{"fw_all_gather": N_BLOCKS, "bw_all_gather": N_BLOCKS,
                                        "bw_reduce_scatter": N_BLOCKS}] * 3
        assert res["counts"] == [{"all_gather": 1, "reduce_scatter": 1}] * 3
        reports = res["after"][-1]
        assert [(fqn, path) for fqn, path, _ in reports] == [("", "eager")] + [
            (f"layers.{i}", "compiled") for i in range(N_BLOCKS)]
        for _, _, units in reports[1:]:  # each block: one unit, resharded after forward
            assert len(units) == 1 and "nesting" in units[0] and "kept" not in units[0], units


def test_blocks_share_one_graph_inductor() -> None:
    for res in run_distributed(_blocks_rank, 2, "module.compile", "inductor", timeout=900):
        assert_close(res, 1e-5)
        assert res["unique_graphs"] == 1 and res["recompiles"] == 0
        assert res["counts"] == [{"all_gather": 1, "reduce_scatter": 1}] * 3
