"""``FSDPModule.reset_iter_state()`` (FSDP2's recovery after an exception
aborted a forward or backward): training goes on as if the failed
iterations had not run, on 2 gloo ranks, ours (eager and compiled) beside
FSDP2, against the one-process reference trained on the steps that finished."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp

import compiled_fsdp
from compiled_fsdp.core import compat
from compiled_fsdp.tools.models import batch, loss_fn, tiny

from _dist import run_distributed
from _parity import full_diff, full_params

FAILS = {1: "forward", 2: "backward"}  # step -> where it raises
FSDP2_HAS_IT = compat.fsdp2_has_reset_iter_state()


def _train(rank: int, world: int, fully_shard: Callable, backend: str, fails: dict[int, str]) -> tuple[dict, dict]:
    torch.manual_seed(0)
    ref = tiny()
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    armed = {"where": None}

    def raise_in_forward(module: nn.Module, args: Any) -> None:
        if armed["where"] == "forward":  # after the block's gather: mid-forward
            raise RuntimeError("boom in forward")

    def raise_in_backward(module: nn.Module, grad_output: Any) -> None:
        if armed["where"] == "backward":  # after the head and layers.1 reduced
            raise RuntimeError("boom in backward")

    model.layers[1].register_forward_pre_hook(raise_in_forward)
    model.layers[0].register_full_backward_pre_hook(raise_in_backward)
    run = model if backend == "eager" else torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    raised = []
    for step in range(5):
        tokens = [batch(ref.cfg, 2, 100 * step + r) for r in range(world)]
        armed["where"] = fails.get(step)
        try:
            loss_fn(run(tokens[rank]), tokens[rank]).backward()
        except RuntimeError as exc:
            raised.append((step, str(exc)))
            armed["where"] = None
            model.reset_iter_state()
            opt.zero_grad()  # what the failed iteration reduced, if anything
            continue
        opt.step()
        opt.zero_grad()
        (sum(loss_fn(ref(t), t) for t in tokens) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = full_params(model)
    diff = full_diff(full, ref)
    nested = None
    try:
        model.layers[0].reset_iter_state()
    except RuntimeError as exc:
        nested = str(exc)
    return full, {"diff": diff, "raised": raised, "nested": nested}


def _both(rank: int, world: int, backend: str) -> dict:
    return _train(rank, world, compiled_fsdp.fully_shard, backend, FAILS)[1]


def _forward_only(rank: int, world: int, backend: str) -> dict:
    ours, res = _train(rank, world, compiled_fsdp.fully_shard, backend, {1: "forward"})
    if FSDP2_HAS_IT:
        theirs, res["fsdp2"] = _train(rank, world, torch_fsdp.fully_shard, "eager", {1: "forward"})
        res["vs_fsdp2"] = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    return res


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_reset_iter_state_after_exception(backend: str) -> None:
    """An exception mid-forward (step 1, after a gather) and one mid-backward
    (step 2, after two groups issued their reductions), each followed by
    ``reset_iter_state()`` and ``zero_grad()``: the parameters after 5 steps
    equal the reference trained on steps 0, 3 and 4 (within 1e-6: 2 ranks
    sum in another order than one process). Beside FSDP2 (torch 2.13+) with
    the forward failure only: the same parameters. (After the backward
    failure FSDP2 on torch 2.13 adds the failed backward's not yet reduced
    gradients of the root's group to the next step, 0.03 off here, though its
    documentation says they are lost; ours drops them.) On a nested module
    the method raises as FSDP2's does."""
    # Each scenario in fresh processes, and the steps that raised are
    # checked: run after the two-failure scenario in the same process (torch
    # 2.15, aot_eager), ours raised in every step, a Dynamo error counted as
    # a failed step, and matched its reference trained on no step, 0.04 from
    # FSDP2: a second compiled model with a full backward pre-hook failed on
    # 2.15, since fixed ([Note: The property as a frame] in runtime/module_class.py,
    # tests/test_untraced_frames.py::test_second_model_with_a_backward_pre_hook).
    for res in run_distributed(_both, 2, backend, timeout=600):
        assert [s for s, _ in res["raised"]] == [1, 2], res
        assert res["diff"] < 1e-6 and "root" in res["nested"], res
    for res in run_distributed(_forward_only, 2, backend, timeout=600):
        assert [s for s, _ in res["raised"]] == [1], res
        assert res["diff"] < 1e-6, res
        if FSDP2_HAS_IT:
            assert res["fsdp2"]["diff"] < 1e-6 and res["vs_fsdp2"] < 1e-6, res
            assert "root" in res["fsdp2"]["nested"], res
