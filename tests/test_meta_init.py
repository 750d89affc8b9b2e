"""Meta-device init: build under ``torch.device("meta")``, ``fully_shard``,
``to_empty``, then initialize or load. See [Note: Meta-device init] in
compiled_fsdp/runtime/param.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from compiled_fsdp import fully_shard

from _dist import run_distributed
from _models import gpt_case
from _parity import assert_close, run_parity, whole


def _shard(model: nn.Module) -> nn.Module:
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


def _from_meta(build, load_from: nn.Module) -> nn.Module:
    """Built on meta, sharded, materialized, then loaded from ``load_from``'s full
    state dict with the distributed state-dict API (rank 0's copy is broadcast)."""
    with torch.device("meta"):
        model = build()
    _shard(model)
    assert all(p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    set_model_state_dict(model, load_from.state_dict(),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _parity_rank(rank: int, world: int, backend: str) -> dict:
    build, make_batch, loss = gpt_case(True)  # tied, uneven rows
    wrap = None if backend == "none" else (lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return run_parity(rank, build, _shard, make_batch, loss, wrap=wrap,
                      prepare=lambda ref: _from_meta(build, ref))


@pytest.mark.parametrize("world,backend", [(2, "none"), (2, "aot_eager"), (3, "none")])
def test_meta_init_then_load_trains_like_the_reference(world: int, backend: str) -> None:
    """Bitwise on 2 ranks (eager and aot_eager), within 1e-6 on 3."""
    for res in run_distributed(_parity_rank, world, backend):
        assert_close(res, 0.0 if world == 2 else 1e-6)


def _reset_rank(rank: int, world: int) -> dict:
    build, make_batch, loss_fn = gpt_case(False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    _shard(model)
    model.to_empty(device="cpu")
    model.init_weights()  # reset_parameters() of every submodule, and the rest
    runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        (tokens,) = make_batch(step)
        loss = loss_fn(runner(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "devices": {str(p.device) for p in model.parameters()}}


def test_meta_init_with_init_weights_compiles_and_is_deterministic() -> None:
    """``init_weights()`` (``reset_parameters()`` per submodule) on the DTensor
    shards, then compiled steps (no "two devices" error); the same seed gives the
    same shards in a new job."""
    first, second = run_distributed(_reset_rank, 2), run_distributed(_reset_rank, 2)
    for a, b in zip(first, second):
        assert a["devices"] == {"cpu"}
        assert all(torch.isfinite(torch.tensor(a["losses"])))
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


class _Wide(nn.Module):
    """64 MiB of fp32 parameters in 8 layers (``scale`` 1)."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024 // scale, 2048 // scale, bias=False) for _ in range(8))


def _status_mb(key: str) -> float:
    """A ``/proc/self/status`` memory line (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024  # kB


def _set_up(meta: bool, scale: int) -> nn.Module:
    with torch.device("meta" if meta else "cpu"):
        model = _Wide(scale)
    _shard(model)
    if meta:
        model.to_empty(device="cpu")
    for layer in model.layers:
        layer.reset_parameters()
    return model


def _setup_peak_rank(rank: int, world: int, meta: bool) -> dict:
    full_mb = 8 * 1024 * 2048 * 4 / 2**20
    # The same set-up on a model 1/1024 the size first: the code it runs is
    # then resident, and the peak below is the model's (a rank forked from the
    # tests' fork server maps torch's libraries in as it first runs them).
    _set_up(meta, scale=32)
    with open("/proc/self/clear_refs", "w") as f:  # the peak RSS (VmHWM) restarts from now
        f.write("5")
    before = _status_mb("VmRSS")
    model = _set_up(meta, scale=1)
    grown = _status_mb("VmHWM") - before
    local_mb = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    return {"grown_mb": grown, "full_mb": full_mb, "local_mb": local_mb}


def test_meta_setup_never_holds_the_full_model() -> None:
    """Peak RSS growth during set-up is about the rank's shards (1/N of the model),
    where building the same model on the CPU first grows it by the whole model."""
    for res in run_distributed(_setup_peak_rank, 2, True):
        assert res["local_mb"] == res["full_mb"] / 2
        assert res["grown_mb"] < 0.75 * res["full_mb"], res
    for res in run_distributed(_setup_peak_rank, 2, False):  # the control
        assert res["grown_mb"] >= 0.9 * res["full_mb"], res


def _forward_on_meta_rank(rank: int, world: int) -> str:
    build, make_batch, _ = gpt_case(False)
    with torch.device("meta"):
        model = build()
    _shard(model)
    try:
        model(*make_batch(0))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_forward_on_meta_raises_on_every_rank() -> None:
    for msg in run_distributed(_forward_on_meta_rank, 2, timeout=120):
        assert "meta device" in msg and "to_empty" in msg, msg


class _NormAfter(nn.Module):
    """PyTorch's test_reset_sharded_param_in_lazy_init: the root's own
    parameter, left on meta by ``to_empty`` of the children only, is assigned
    anew (a new ``nn.Parameter``) by the user's init, from the sharded children."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _assigned_rank(rank: int, world: int, which: str, backend: str) -> dict:
    """Two SGD steps on one batch every rank shares (so the mean gradient is
    the single-process one): the losses and the parameters, and the same
    for the single-process reference (``which`` "ref")."""
    from torch.distributed import fsdp as torch_fsdp

    weights = [torch.arange(9.0).reshape(3, 3) / (i + 2) for i in range(2)]
    with torch.device("meta" if which != "ref" else "cpu"):
        model = _NormAfter()
    if which != "ref":
        shard = fully_shard if which == "ours" else torch_fsdp.fully_shard
        for m in (model.layer1, model.layer2, model):
            shard(m)
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        for w, p in zip(weights, (model.layer1.weight, model.layer2.weight)):
            (p.to_local() if which != "ref" else p).copy_(torch.chunk(w, world)[rank] if which != "ref" else w)
    model.init_weight_norm()
    run = model if backend == "eager" else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = run(torch.ones(3, 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = {n: whole(p) if which != "ref" else p.detach() for n, p in model.named_parameters()}
    return {"losses": losses, "params": {n.replace("_orig_mod.", ""): p.tolist() for n, p in full.items()}}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_parameter_assigned_anew_before_lazy_init(backend: str) -> None:
    """A parameter the user's init replaced with a new ``nn.Parameter`` after
    ``fully_shard`` (its shard still on meta: PyTorch's
    test_reset_sharded_param_in_lazy_init) becomes the parameter at the
    root's lazy init, as in FSDP2 (``FSDPParam.reset_sharded_param``): an
    optimizer made after the init steps it. After two SGD steps, losses and
    parameters bitwise the single-process reference's; the first loss is
    FSDP2's. Before, lazy init refused it as still on meta."""
    ref = run_distributed(_assigned_rank, 1, "ref", "eager")[0]
    theirs = run_distributed(_assigned_rank, 2, "fsdp2", "eager")
    for ours in run_distributed(_assigned_rank, 2, "ours", backend):
        assert ours == ref, (ours, ref)
        assert ours["losses"][0] == theirs[0]["losses"][0]


def _assigned_plain_rank(rank: int, world: int) -> str:
    with torch.device("meta"):
        model = _NormAfter()
    for m in (model.layer1, model.layer2, model):
        fully_shard(m)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    model.weight_norm = nn.Parameter(torch.ones(3))  # (a plain tensor: no rank's rows)
    try:
        model(torch.ones(3, 3))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_parameter_assigned_anew_as_a_plain_tensor_is_refused() -> None:
    """Assigned anew as a plain tensor (not a DTensor placed as the old one),
    the parameter cannot be taken without losing an optimizer made meanwhile:
    every rank refuses it at lazy init, saying what to do."""
    for message in run_distributed(_assigned_plain_rank, 2):
        assert "'weight_norm', still on meta, was replaced after fully_shard by a Parameter" in message, message
        assert "initialize the parameter in place" in message
