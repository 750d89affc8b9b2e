"""Sharded parameters are DTensors: the standard PyTorch APIs work unchanged.

Gradient clipping, torch.distributed.checkpoint (DCP) and the distributed
state-dict API, each against a single-process reference or the values saved,
on real gloo ranks. See [Note: Parameters are DTensors] in compiled_fsdp/runtime/param.py.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from compiled_fsdp import fully_shard
from compiled_fsdp.tools.check_worker import local_tensor, max_diff, shard_specs
from examples.gpt import GPT, GPTConfig

from _dist import run_distributed
from _models import gpt_case
from _parity import whole


def _shard(model: nn.Module) -> nn.Module:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _wrap(model: nn.Module, backend: str) -> nn.Module:
    if backend == "eager":
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)


def _local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): local_tensor(p.detach()).clone() for n, p in model.named_parameters()}


# -- 1. clip_grad_norm_ ---------------------------------------------------------


def _clip_rank(rank: int, world: int, backend: str, foreach: bool) -> dict:
    build, make_batch, loss_fn = gpt_case(False)
    ref = build()
    model = _shard(copy.deepcopy(ref))
    specs = shard_specs(model)
    runner = _wrap(model, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    spec_of = {n: specs[id(p)] for n, p in model.named_parameters()}
    norms, param_diff = [], []
    for step in range(3):
        inputs = make_batch(step)
        loss_fn(runner(*inputs), *inputs).backward()
        loss_fn(ref(*inputs), *inputs).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=foreach)
        is_dtensor = isinstance(norm, DTensor)
        norms.append((float(norm.full_tensor() if is_dtensor else norm), float(ref_norm)))
        grad_placements = tuple(model.layers[0].attn.qkv.weight.grad.placements)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        param_diff.append(max(max_diff(p, spec_of[n].local(dict(ref.named_parameters())[n].detach(), rank))
                              for n, p in model.named_parameters()))
    p0 = model.layers[0].attn.qkv.weight
    return {"norms": norms, "param_diff": param_diff, "placements": tuple(p0.placements),
            "grad_placements": grad_placements}


@pytest.mark.parametrize("backend,foreach", [("eager", True), ("eager", False), ("aot_eager", True),
                                             ("inductor", None)])
def test_clip_grad_norm(backend: str, foreach: Optional[bool]) -> None:
    results = run_distributed(_clip_rank, 2, backend, foreach)
    for res in results:
        assert res["placements"] == res["grad_placements"] == (Shard(0),)
        for norm, ref_norm in res["norms"]:
            # The global norm (not this rank's: 3.3 vs 4.8 before DTensors), up to summation order.
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, res["norms"]
            assert ref_norm > 0.05  # clipping is active
        assert max(res["param_diff"]) <= 1e-5, res["param_diff"]
    assert results[0]["norms"] == results[1]["norms"]  # every rank clips by the same factor


# -- 2. DCP and the distributed state-dict API round-trip bitwise -------------


def _train(runner: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    _, make_batch, loss_fn = gpt_case(False)
    losses = []
    for step in steps:
        inputs = make_batch(step)
        loss = loss_fn(runner(*inputs), *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fresh(seed: int, backend: str = "eager") -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    build, _, _ = gpt_case(False)
    model = build()
    with torch.no_grad():  # a different model, so a load that does nothing is caught
        for p in model.parameters():
            p.add_(seed)
    _shard(model)
    return model, _wrap(model, backend), torch.optim.AdamW(model.parameters(), lr=1e-3)


def _optim_locals(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [local_tensor(v).clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _roundtrip_rank(rank: int, world: int, root: str) -> dict:
    model, runner, opt = _fresh(0)
    _train(runner, opt, range(2))
    want, want_opt = _local_params(model), _optim_locals(opt)
    out = {}

    # model.state_dict() straight into DCP.
    d = os.path.join(root, "plain")
    dcp.save(model.state_dict(), checkpoint_id=d)
    other, _, _ = _fresh(1)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=d)
    other.load_state_dict(sd)
    out["plain"] = _same(_local_params(other), want)

    # The distributed state-dict API, sharded, model and optimizer.
    d = os.path.join(root, "dsd")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
    other, _, other_opt = _fresh(1)
    _train(other, other_opt, range(1))  # optimizer state exists, with other values
    msd, osd = get_state_dict(other, other_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=d)
    set_model_state_dict(other, state["model"])
    set_optimizer_state_dict(other, other_opt, state["optim"])
    out["dsd"] = _same(_local_params(other), want) and all(
        torch.equal(a, b) for a, b in zip(_optim_locals(other_opt), want_opt))

    # Full state dicts offloaded to CPU: rank 0 holds them, rank 0 broadcasts them back.
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=full_opts)
    # (a copy, as from disk: on CPU, offloading keeps tensors such as AdamW's
    # ``step`` shared with the live optimizer, which trains on below)
    full_osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full_opts))
    out["full_on_rank"] = bool(full)
    gathered = {n: whole(p) for n, p in model.named_parameters()}  # a collective: every rank
    if rank == 0:
        out["full_values"] = all(not isinstance(v, DTensor) and v.device.type == "cpu" for v in full.values())
        out["full_exact"] = all(torch.equal(full[n], t) for n, t in gathered.items())
    other, _, other_opt = _fresh(1)
    _train(other, other_opt, range(1))
    load_opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(other, full, options=load_opts)
    set_optimizer_state_dict(other, other_opt, full_osd, options=load_opts)
    out["full"] = _same(_local_params(other), want) and all(
        torch.equal(a, b) for a, b in zip(_optim_locals(other_opt), want_opt))
    # The loads kept our DTensor parameters (and their optimizer state): training continues bitwise.
    more = _train(model, opt, range(2, 3))
    more_other = _train(other, other_opt, range(2, 3))
    out["continues"] = more == more_other and _same(_local_params(other), _local_params(model))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_roundtrips(world: int, tmp_path) -> None:
    for rank, res in enumerate(run_distributed(_roundtrip_rank, world, str(tmp_path))):
        assert res["plain"] and res["dsd"] and res["full"] and res["continues"], res
        assert res["full_on_rank"] == (rank == 0)
        if rank == 0:
            assert res["full_values"] and res["full_exact"]


# -- 3. resume in fresh processes, 4. resharding, 5. keys ----------------------


def _first_run(rank: int, world: int, root: str, backend: str) -> dict:
    model, runner, opt = _fresh(0, backend)
    _train(runner, opt, range(2))
    msd, osd = get_state_dict(runner, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    full = get_model_state_dict(runner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))
    reference_keys = list(gpt_case(False)[0]().state_dict())
    losses = _train(runner, opt, range(2, 4))
    return {"losses": losses, "params": _local_params(model), "keys": list(msd) == reference_keys}


def _resumed_run(rank: int, world: int, root: str, backend: str) -> dict:
    model, runner, opt = _fresh(1, backend)
    msd, osd = get_state_dict(runner, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(runner, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = torch.load(os.path.join(root, "full.pt"))
    exact = all(torch.equal(whole(p), full[n]) for n, p in model.named_parameters())
    losses = _train(runner, opt, range(2, 4)) if world == 2 else []
    return {"losses": losses, "params": _local_params(model), "exact": exact}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_resume_loses_nothing(backend: str, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    first = run_distributed(_first_run, 2, root, backend)
    resumed = run_distributed(_resumed_run, 2, root, backend)  # new processes
    for a, b in zip(first, resumed):
        assert a["keys"], "checkpoint keys are not the model's FQNs"
        assert b["exact"]
        assert a["losses"] == b["losses"]
        assert _same(a["params"], b["params"])


def test_reshard_2_to_3_and_to_one_process(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    run_distributed(_first_run, 2, root, "eager")
    for res in run_distributed(_resumed_run, 3, root, "eager"):
        assert res["exact"]
    # A plain single-process model, no process group: DCP loads the full tensors.
    model = gpt_case(False)[0]()
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=root)  # the model part of a model + optimizer checkpoint
    full = torch.load(os.path.join(root, "full.pt"))
    assert sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in sd)


# -- bad input ------------------------------------------------------------------


def _mismatch_rank(rank: int, world: int, root: str) -> dict:
    model, _, _ = _fresh(0)
    dcp.save(get_model_state_dict(model), checkpoint_id=root)
    out = {}
    for what, cfg in [("shape", GPTConfig(vocab=67, dim=32, n_layers=2, n_heads=2, seq=16)),
                      ("key", GPTConfig(vocab=67, dim=24, n_layers=3, n_heads=2, seq=16))]:
        torch.manual_seed(0)
        other = _shard(GPT(cfg))
        before = _local_params(other)
        try:
            dcp.load(get_model_state_dict(other), checkpoint_id=root)
            out[what] = "no error"
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            out[what] = str(exc)
        out[what + "_untouched"] = _same(_local_params(other), before)
    return out


def test_mismatched_checkpoint_errors_on_every_rank(tmp_path) -> None:
    """Wider parameters, or a layer the checkpoint lacks: DCP raises on every rank,
    naming the key (and both shapes), and loads nothing."""
    for res in run_distributed(_mismatch_rank, 2, str(tmp_path / "ckpt"), timeout=120):
        assert "embed.weight" in res["shape"] and "67, 24" in res["shape"] and "67, 32" in res["shape"], res
        assert "layers.2." in res["key"], res
        assert res["shape_untouched"] and res["key_untouched"]
