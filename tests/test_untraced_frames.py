"""Frames ``torch.compile`` leaves to run eagerly still gather: every way a
compiled model's forward can end up untraced trains exactly like the eager
runtime, with one reduction per gradient. See [Note: Untraced root frames] in
compiled_fsdp/_state.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import explain, fully_shard
from _dist import run_distributed
from _graphs import GraphCapture
from _models import gpt_case
from _parity import assert_close, run_parity

WAYS = ["flop_counter", "comm_debug", "recompile_limit", "compile_disabled", "failing_backend",
        "disabled_block"]


def _shard(model: torch.nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def _rank(rank: int, world: int, way: str) -> dict:
    build, make_batch, loss = gpt_case(True)  # tied embedding and head, uneven rows
    capture = GraphCapture()
    backend = capture.backend
    mode = contextlib.nullcontext
    flops: list[int] = []
    if way == "flop_counter":
        from torch.utils.flop_counter import FlopCounterMode

        def mode():  # noqa: F811
            counter = FlopCounterMode(display=False)

            @contextlib.contextmanager
            def counting():
                with counter:
                    yield
                flops.append(counter.get_total_flops())

            return counting()
    elif way == "comm_debug":
        from torch.distributed.tensor.debug import CommDebugMode

        mode = CommDebugMode
    elif way == "recompile_limit":  # three sequence lengths, one graph allowed
        torch._dynamo.config.recompile_limit = 1
        base = make_batch
        make_batch = lambda step: (base(step)[0][:, : (8, 12, 16)[step % 3]],)  # noqa: E731
    elif way == "compile_disabled":
        torch._dynamo.config.disable = True  # what TORCH_COMPILE_DISABLE=1 sets
    elif way == "failing_backend":
        torch._dynamo.config.suppress_errors = True

        def backend(gm, example_inputs):  # noqa: F811
            raise RuntimeError("this backend always fails")

    def wrap(model: torch.nn.Module):
        if way == "disabled_block":
            block = model.layers[1]
            block.forward = torch.compiler.disable(block.forward)
        compiled = torch.compile(model, backend=backend, dynamic=False)

        def run(*inputs):
            with mode():
                return compiled(*inputs)

        return run

    seen: list = []
    res = run_parity(rank, build, _shard, make_batch, loss, steps=3, wrap=wrap,
                     after_step=lambda m: seen.append(explain(m)) or capture.take_runtime())
    res["flops"] = flops
    res["explain"] = [(r.fqn, r.path, r.reason) for r in seen[-1]]
    return res


@pytest.mark.parametrize("way", WAYS)
def test_untraced_frames_train_like_eager(way: str) -> None:
    """Bitwise equal to the reference; every module's gradient reduced once per
    step (3 modules: the eager runtime's reduce-scatters plus the graphs'); no
    per-parameter marker collective."""
    for res in run_distributed(_rank, 2, way, timeout=600):
        assert_close(res, 0.0)
        for eager, graph in zip(res["counts"], res["after"]):
            assert not any(k.startswith("unbucketed") for k in eager), eager
            assert eager.get("reduce_scatter", 0) + graph.get("bw_reduce_scatter", 0) == 3, (eager, graph)
        paths = {fqn: path for fqn, path, _ in res["explain"]}
        if way == "disabled_block":  # only the disabled block runs eagerly
            assert paths == {"": "compiled", "layers.0": "compiled", "layers.1": "fallback"}
            assert res["after"][-1].get("bw_reduce_scatter") == 2
        else:
            assert set(paths.values()) == {"fallback"}
            root_reason = next(reason for fqn, _, reason in res["explain"] if fqn == "")
            assert "without tracing it" in root_reason
        if way == "flop_counter":
            assert len(res["flops"]) == 3 and min(res["flops"]) > 0
