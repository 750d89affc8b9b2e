"""Frames ``torch.compile`` leaves to run eagerly still gather: every way a
compiled model's forward can end up untraced trains exactly like the eager
runtime, with one reduction per gradient. See [Note: Untraced root frames] in
compiled_fsdp/compile/path.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from compiled_fsdp import explain, fully_shard

from _dist import run_distributed
from _graphs import GraphCapture
from _models import gpt_case
from _parity import assert_close, run_parity, whole

WAYS = ["flop_counter", "comm_debug", "recompile_limit", "compile_disabled", "failing_backend",
        "disabled_block", "blocks_flop_counter", "blocks_compile_disabled"]


def _shard(model: torch.nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def _rank(rank: int, world: int, way: str) -> dict:
    # "blocks_...": each block compiled on its own, the root eager (see [Note:
    # Blocks compiled on their own] in compiled_fsdp/compile/entry.py).
    per_block = way.startswith("blocks_")
    way = way.removeprefix("blocks_")
    # Tied embedding and head, uneven rows. (With a disabled block the root's
    # frame is skipped whole, so the tied weight is never split between two
    # fragments: see the test's docstring.)
    build, make_batch, loss = gpt_case(True)
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
        if per_block:
            for block in model.layers:
                block.compile(backend=backend, dynamic=False)
        compiled = model if per_block else torch.compile(model, backend=backend, dynamic=False)

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
    """Bitwise equal to the reference (every rank sees the same batch, so a
    gradient reduced twice would come out doubled); no per-parameter marker
    collective. Untraced: all three modules run in the eager runtime, one
    reduce-scatter each, nothing in graphs (past the recompile limit: from the
    second step, the first is compiled). A disabled block breaks the graph in
    the root's loop over its blocks, so Dynamo skips the root's frame whole
    and runs it as Python (measured on 2.13.0: "graph break in loop ... frame
    skipped"): untraced from the first step, like the others; explain()
    names that break for it. The root's reason is otherwise always that it
    ran untraced: the parameter property's getter
    is never a Dynamo frame of its own ([Note: The property as a frame] in
    runtime/module_class.py), which once gave a failing backend's root and the
    disabled block's first step tiny compiled getter graphs that gathered
    and reduced the root's parameters in graphs."""
    for res in run_distributed(_rank, 2, way, timeout=600):
        assert_close(res, 0.0)
        for step, (eager, graph) in enumerate(zip(res["counts"], res["after"])):
            assert not any(k.startswith("unbucketed") for k in eager), eager
            if way == "recompile_limit" and step == 0:  # the one graph allowed
                assert eager == {} and graph["bw_reduce_scatter"] == 3, (eager, graph)
            elif way.startswith("blocks_") and step == 0:
                # Before the first step the blocks are predicted to compile their own
                # frames (they are compiled so), so the root hands layers.0 its gather
                # and layers.0, found untraced, hands layers.1 its own: two gathers
                # issued, waited and dropped ([Note: Gathers handed to the next
                # block's graph]). From the second step the blocks are known to fall back.
                assert eager == {"all_gather": 7, "reduce_scatter": 3} and graph == {}, (eager, graph)
            else:
                assert eager == {"all_gather": 5, "reduce_scatter": 3} and graph == {}, (eager, graph)
        paths = {fqn: path for fqn, path, _ in res["explain"]}
        if way.startswith("blocks_"):  # the root runs eagerly; the blocks fall back
            assert paths == {"": "eager", "layers.0": "fallback", "layers.1": "fallback"}, paths
            assert all("without tracing it" in reason for fqn, _, reason in res["explain"] if fqn)
        else:
            assert set(paths.values()) == {"fallback"}
            root_reason = next(reason for fqn, _, reason in res["explain"] if fqn == "")
            if way == "disabled_block":  # (explain() names the break that made Dynamo skip the frame)
                assert root_reason.startswith("Dynamo skipped its forward's frame"), root_reason
                assert "torch.compiler.disable()" in root_reason, root_reason
            else:
                assert "without tracing it" in root_reason, root_reason
        if way == "flop_counter":
            assert len(res["flops"]) == 3 and min(res["flops"]) > 0


def _two_models_rank(rank: int, world: int) -> list:
    """Two models trained one after the other in this process, each with a
    full backward pre-hook on a sharded block, compiled (aot_eager): each
    one's distance to its one-process reference after 3 AdamW steps."""
    import copy

    from compiled_fsdp.tools.models import batch, loss_fn, tiny

    diffs = []
    for _ in range(2):
        ref = tiny()
        model = copy.deepcopy(ref)
        _shard(model)
        model.layers[0].register_full_backward_pre_hook(lambda m, g: None)
        run = torch.compile(model, backend="aot_eager")
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
        for step in range(3):
            tokens = [batch(ref.cfg, 2, 100 * step + r) for r in range(world)]
            loss_fn(run(tokens[rank]), tokens[rank]).backward()
            (sum(loss_fn(ref(t), t) for t in tokens) / world).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        full = {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}
        diffs.append(max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    return diffs


def test_second_model_with_a_backward_pre_hook() -> None:
    """[Note: The property as a frame]: the second model trains as the first,
    within 1e-6 of its reference (2 ranks sum in another order than one
    process). On torch 2.15 it raised in every step (Dynamo compiled the
    parameter property as a frame and traced the eager runtime behind it)."""
    for diffs in run_distributed(_two_models_rank, 2, timeout=600):
        assert len(diffs) == 2 and max(diffs) < 1e-6, diffs
