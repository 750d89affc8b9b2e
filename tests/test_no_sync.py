"""Gradient accumulation without sync (eager runtime): FSDP2's
``set_requires_gradient_sync`` / ``set_reshard_after_backward``. See [Note:
Gradient accumulation without sync] in compiled_fsdp/_module.py."""
from __future__ import annotations

import copy

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import FSDPModule, fully_shard
from compiled_fsdp._check_worker import max_diff, shard_specs
from _dist import run_distributed
from _models import gpt_case


def _accumulate_rank(rank: int, world: int, micro: int, keep_gathered: bool) -> dict:
    build, make_batch, loss_fn = gpt_case(True)  # tied, uneven rows
    ref = build()
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    specs = shard_specs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    named_ref = dict(ref.named_parameters())
    out = {"grad": [], "param": [], "counts": [], "grad_none_before_sync": True}
    for step in range(2):
        compiled_fsdp.reset_collective_counts()
        for i in range(micro):
            last = i == micro - 1
            model.set_requires_gradient_sync(last)
            if keep_gathered:
                model.set_reshard_after_backward(last)
            (tokens,) = make_batch(10 * step + i)
            loss_fn(model(tokens), tokens).backward()
            loss_fn(ref(tokens), tokens).backward()
            if not last:
                out["grad_none_before_sync"] &= all(p.grad is None for p in model.parameters())
        out["counts"].append(compiled_fsdp.collective_counts())
        out["grad"].append(max(max_diff(p.grad, specs[id(p)].local(named_ref[n].grad, rank))
                               for n, p in model.named_parameters()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["param"].append(max(max_diff(p, specs[id(p)].local(named_ref[n].detach(), rank))
                                for n, p in model.named_parameters()))
    out["is_fsdp_module"] = [isinstance(m, FSDPModule) for m in (model, *model.layers, model.norm)]
    return out


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_accumulation_without_sync_matches_the_reference(keep_gathered: bool) -> None:
    """3 micro-batches per step, sync only on the last: bitwise equal to a reference
    that accumulates the same micro-batches; one reduce-scatter per module per
    step (3 modules); no gradient on the shards before the synced backward. With
    the parameters kept after backward, the next micro-batch gathers nothing."""
    for res in run_distributed(_accumulate_rank, 2, 3, keep_gathered):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]
        for counts in res["counts"]:
            assert counts["reduce_scatter"] == 3
            # forward gathers per micro-batch: 3 modules; backward re-gathers the 2
            # resharded blocks (the root keeps its parameters: FSDP2's rule)
            per_micro = 3 + 2
            assert counts["all_gather"] == (per_micro if keep_gathered else 3 * per_micro) + (
                2 * 2 if keep_gathered else 0)
        assert res["is_fsdp_module"] == [True, True, True, False]


def _bad_rank(rank: int, world: int) -> list[str]:
    build, _, _ = gpt_case(False)
    model = build()
    fully_shard(model)
    msgs = []
    try:
        model.set_requires_gradient_sync("no")
    except TypeError as exc:
        msgs.append(str(exc))
    return msgs


def test_bad_flag_is_a_clear_error() -> None:
    for msgs in run_distributed(_bad_rank, 2, timeout=120):
        assert len(msgs) == 1 and "expected True or False" in msgs[0]
