"""fully_shard's contract: sharding, FQNs, state dicts, and clear errors for bad input."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

import compiled_fsdp
from compiled_fsdp import fully_shard
from examples.gpt import Block, tiny, tiny_tied

from _dist import run_distributed


def test_requires_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(nn.Linear(3, 3))


def _sharding_rank(rank: int, world: int) -> dict:
    ref = tiny()
    model = copy.deepcopy(ref)
    fully_shard(model, policy={Block})
    total = sum(p.numel() for p in ref.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    compiled_fsdp.reset_collective_counts()
    # Reading parameters and the state dict outside forward returns shards, no communication.
    w = model.layers[0].attn.qkv.weight
    # Each property's getter names its parameter in its code, in no closure cell
    # ([Note: The getter's name a constant of its code] in runtime/module_class.py).
    getters = [(getattr(type(m), n).fget, n) for m in model.modules() for n in m.__dict__.get("_fsdp_params", {})]
    named_in_code = all(f.__closure__ is None and n in f.__code__.co_consts for f, n in getters)
    sd = model.state_dict()
    counts = compiled_fsdp.collective_counts()
    full_opts = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(model, options=full_opts)
    exact = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    # Round trip: perturb the reference, load its full state dict, gather again.
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    set_model_state_dict(model, ref.state_dict(), options=full_opts)
    again = get_model_state_dict(model, options=full_opts)
    roundtrip = all(torch.equal(again[k], v) for k, v in ref.state_dict().items())
    # load_state_dict(assign=True) swaps in new DTensors: ours are registered again,
    # with the loaded values in the storage the collectives read.
    before = [id(p) for p in model.parameters()]
    model.load_state_dict({k: v.detach() * 2 for k, v in model.state_dict().items()}, assign=True)
    assign_kept = before == [id(p) for p in model.parameters()]
    doubled = get_model_state_dict(model, options=full_opts)
    assign_exact = all(torch.equal(doubled[k], v * 2) for k, v in ref.state_dict().items())
    return {
        "total": total,
        "local": local,
        "w_shape": tuple(w.to_local().shape),
        "named_in_code": named_in_code and len(getters) == len(list(ref.named_parameters())),
        "w_global": (tuple(w.shape), tuple(w.placements)),
        "is_param": isinstance(w, nn.Parameter) and isinstance(w, DTensor),
        "keys_match": list(sd) == list(ref.state_dict()),
        "counts": counts,
        "exact": exact,
        "roundtrip": roundtrip,
        "assign": assign_kept and assign_exact,
        "grads_none": all(p.grad is None for p in model.parameters()),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_sharding_and_state_dicts(world: int) -> None:
    results = run_distributed(_sharding_rank, world)
    # The ranks' DTensor shards partition the parameters exactly (no padding in them).
    assert sum(res["local"] for res in results) == results[0]["total"]
    for res in results:
        # Each rank holds about 1/N: at most one row per parameter more.
        assert res["local"] <= res["total"] / world + 0.02 * res["total"]
        assert res["w_shape"] == (-(-72 // world), 24) and res["is_param"]
        assert res["w_global"] == ((72, 24), (Shard(0),))
        assert res["keys_match"] and res["counts"] == {}
        assert res["exact"] and res["roundtrip"] and res["grads_none"] and res["assign"]
        assert res["named_in_code"]


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.0))


def _bad_input_rank(rank: int, world: int) -> list[str]:
    messages = []

    def expect(fn, match: str, error: type = ValueError) -> None:
        with pytest.raises(error, match=match) as info:
            fn()
        messages.append(str(info.value))

    m = nn.Linear(4, 4)
    fully_shard(m)
    expect(lambda: fully_shard(m), "already been applied", AssertionError)  # FSDP2's type

    # A weight shared across two applications: as FSDP2, raised at the first forward.
    tied = tiny_tied()  # head.weight is embed.weight: shard the head alone, then the root
    fully_shard(tied.head)
    fully_shard(tied)
    expect(lambda: tied(torch.zeros(1, 4, dtype=torch.long)), "already managed by another fully_shard")

    parent = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(parent)
    fully_shard(parent[0])
    expect(lambda: parent(torch.zeros(1, 4)), "already managed by another fully_shard")

    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    expect(lambda: fully_shard(mixed), "several devices")

    # Only rank 1 is wrong: every rank must raise, none may wait in a collective.
    lopsided = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta" if rank == 1 else "cpu"))
    expect(lambda: fully_shard(lopsided), "several devices.*rank 1")
    expect(lambda: fully_shard(_Scalar()), "scalar")
    different = nn.Linear(4, 5 if rank == 1 else 4)
    expect(lambda: fully_shard(different), "shards different parameters")
    # Only rank 1 turns the checks off: it would skip the check group's
    # new_group the other rank waits in. Agreed before any group is made.
    compiled_fsdp.config.comm.check_collectives = rank != 1
    try:
        expect(lambda: fully_shard(nn.Linear(4, 4)), "config.comm settings")
    finally:
        compiled_fsdp.config.comm.check_collectives = True

    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")
    # FSDP2's int form: 1 is False, the group's size is True, a size that does
    # not divide it is refused (a factor between: tests/test_reshard_int.py).
    with pytest.warns(UserWarning, match="reshard_after_forward=1"):
        one = fully_shard(nn.Linear(2, 2), reshard_after_forward=1)
    assert one._get_fsdp_state().param_group.reshard_after_forward is False
    whole = fully_shard(nn.Linear(2, 2), reshard_after_forward=world)
    assert whole._get_fsdp_state().param_group.reshard_after_forward is True
    with pytest.raises(ValueError, match="reshard_after_forward=3 .* must be a factor"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=3)

    # A parent reading a separately sharded child's parameter in its forward.
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(3, 3)

        def forward(self, x):
            return self.child(x) * self.child.bias.sum()

    p = Parent()
    fully_shard(p.child)
    fully_shard(p)
    with pytest.raises(RuntimeError, match="read during another module's forward"):
        p(torch.randn(2, 3))
    return messages


def test_bad_input_is_a_clear_error_on_every_rank() -> None:
    for messages in run_distributed(_bad_input_rank, 2, timeout=120):
        assert all("fully_shard" in m for m in messages)


@pytest.mark.parametrize("devices,backend,wrong", [
    ({"cuda"}, "gloo", "on cuda.*'gloo' communicates cpu.*use init_process_group\\('nccl'\\)"),
    ({"cpu"}, "nccl", "on cpu.*'nccl' communicates cuda.*move the module"),
    ({"cuda"}, "cpu:gloo,cuda:nccl", None),
    ({"cpu"}, "cpu:gloo,cuda:nccl", None),
    ({"cuda"}, "nccl", None),
    ({"cpu"}, "fake", None),
    ({"meta"}, "nccl", None),  # built on meta: materialized later, on the group's device
    ({"xpu"}, "xccl", None),  # a backend this does not know: not checked
])
def test_device_and_backend_must_match(devices: set, backend: str, wrong) -> None:
    """The check ``fully_shard`` runs (and agrees on across ranks, like every
    check of ``_validate``: test_bad_input_is_a_clear_error_on_every_rank)."""
    from compiled_fsdp.runtime.validation import device_backend_error
    msg = device_backend_error(devices, backend)
    if wrong is None:
        assert msg is None
    else:
        assert msg is not None and re.search(wrong, msg), msg
