"""``shard_placement_fn`` returning ``Shard(dim)`` for a dim other than 0
(experts sharded on their largest dim, as torchtitan shards MoE experts):
[Note: Shard dims] in compiled_fsdp/core/layout.py. On gloo ranks, against
a single-process reference after 3 AdamW steps, beside FSDP2 on the same
mesh, and through DCP into another layout."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import compiled_fsdp
from compiled_fsdp import fully_shard

from _dist import run_distributed
from _graphs import GraphCapture, saved_gathered
from _parity import in_regions, reference_grads, whole

D, H, E = 8, 12, 4


class Experts(nn.Module):
    """Every token through every expert, weighted by the router (dense, so a
    reference needs no dispatch); expert weights stacked on dim 0."""

    def __init__(self, odd: int = 6) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, D, H) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, D) / H ** 0.5)
        self.proj = nn.Linear(odd, D)  # weight (D, odd): dim 1 uneven over 4 ranks when odd = 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)  # (B, T, E)
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w1))
        y = torch.einsum("bteh,ehd->bted", h, self.w2)
        return x + (gate.unsqueeze(-1) * y).sum(2) + self.proj(x[..., : self.proj.in_features])


class Model(nn.Module):
    def __init__(self, odd: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList([Experts(odd) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h.pow(2).mean()


def largest_dim(p: nn.Parameter) -> Shard | None:
    """torchtitan's rule for experts: their largest dim; dim 1 for other matrices."""
    if p.dim() == 3:
        return Shard(max(range(1, 3), key=lambda d: p.shape[d]))
    return Shard(1) if p.dim() == 2 else None


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _shard(model: Model, fn: Any, placement_fn: Any = largest_dim) -> None:
    for layer in model.layers:
        fn(layer, shard_placement_fn=placement_fn)
    fn(model, shard_placement_fn=placement_fn)


def _train(rank: int, world: int, model: nn.Module, ref: nn.Module, run: Any) -> dict:
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    worst, counts = 0.0, []
    for step in range(3):
        compiled_fsdp.reset_collective_counts()
        run(_batch(step, rank)).backward()
        counts.append(compiled_fsdp.collective_counts())
        reference_grads(ref, lambda r: ref(_batch(step, r)), world)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = {n: whole(p) for n, p in model.named_parameters()}
        worst = max(worst, max((full[n.replace("_orig_mod.", "")] - p).abs().max().item()
                               for n, p in ref.named_parameters()))
    return {"worst": worst, "counts": counts}


def _rank(rank: int, world: int, mode: str, root: str) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    ref, model = Model(), Model()
    compiled_fsdp.config.comm.block_regions = mode == "regions"
    _shard(model, fully_shard)
    compiled_fsdp.config.comm.block_regions = False
    if mode == "blocks":  # each block compiled on its own: the gathers handed from block to block
        for layer in model.layers:
            layer.compile(backend="aot_eager", fullgraph=True)
    capture = GraphCapture()
    backend = capture.backend if mode in ("aot_eager", "regions") else mode
    run = model if mode in ("eager", "blocks") else torch.compile(model, backend=backend, fullgraph=True)
    out = _train(rank, world, model, ref, run)
    # Forward graphs and the regions' forward subgraphs in them.
    graphs = [g for fw in capture.forward for g in fw.modules() if isinstance(g, torch.fx.GraphModule)]
    out["saved_gathered"] = [saved_gathered(g) for g in graphs]
    out["regions"] = sum(in_regions(model))
    w1 = model.layers[0].w1
    out["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
    out["w1_local"] = tuple(w1.to_local().shape)
    out["proj_local"] = tuple(model.layers[0].proj.weight.to_local().shape)
    # FSDP2 on the same mesh (its Shard(1) must divide evenly: odd=8), ours beside it, eagerly.
    theirs, mine = Model(odd=8), Model(odd=8)
    _shard(theirs, fsdp2_shard)
    _shard(mine, fully_shard)
    fsdp2 = _train(rank, world, theirs, Model(odd=8), theirs)
    ours = _train(rank, world, mine, Model(odd=8), mine)
    out["vs_fsdp2"] = max((a.to_local() - b.to_local()).abs().max().item()
                          for a, b in zip(mine.parameters(), theirs.parameters()))
    out["fsdp2_worst"], out["ours_even_worst"] = fsdp2["worst"], ours["worst"]
    out["same_placements"] = [str(a.placements) for a in mine.parameters()] == \
        [str(b.placements) for b in theirs.parameters()]
    # DCP: saved as Shard(1) (ours), loaded into ours sharded on dim 0 and into FSDP2's Shard(1).
    if mode == "eager":
        ckpt = os.path.join(root, "ckpt")
        dcp.save(mine.state_dict(), checkpoint_id=ckpt)
        dim0 = Model(odd=8)
        _shard(dim0, fully_shard, None)
        sd = dim0.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        dim0.load_state_dict(sd)
        other = Model(odd=8)
        _shard(other, fsdp2_shard)
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        other.load_state_dict(sd)
        full = {n: whole(p) for n, p in mine.named_parameters()}
        out["dcp"] = max(max((full[n] - whole(p)).abs().max().item() for n, p in m.named_parameters())
                         for m in (dim0, other))
        out["dcp_dim0_placement"] = str(dim0.layers[0].w1.placements)
    return out


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "blocks", "regions", "inductor"])
def test_experts_sharded_on_their_largest_dim(mode: str, tmp_path: Any) -> None:
    """4 ranks. Expert weights ``Shard(2)`` / ``Shard(1)`` (their largest
    dim), matrices ``Shard(1)``, the odd one uneven (6 columns over 4 ranks:
    2, 2, 2, 0): bitwise to the reference (each rank's gradients summed in
    rank order) eager, under aot_eager and with each block compiled on its
    own (the gathers handed from block to block) and compiled whole with its
    blocks as compile regions (aot_eager), within 1e-5 under Inductor;
    compiled whole with ``fullgraph=True``: no eager collective; blocks: the
    eager root's gather and reduce, and the first block's. Beside FSDP2 with the same placements (its
    ``Shard(1)`` must divide evenly): the same placements, and the same
    shards after 3 steps within 1e-6 (gloo sums FSDP2's 4 ranks in another
    order). DCP: a ``Shard(1)`` checkpoint loads into ours sharded on dim 0
    and into FSDP2's ``Shard(1)``, bitwise."""
    for res in run_distributed(_rank, 4, mode, str(tmp_path), timeout=900):
        tol = 1e-5 if mode == "inductor" else 0.0
        assert res["worst"] <= tol, res
        assert res["placements"]["layers.0.w1"] == "(Shard(dim=2),)", res["placements"]
        assert res["placements"]["layers.0.w2"] == "(Shard(dim=1),)", res["placements"]
        assert res["placements"]["layers.0.proj.weight"] == "(Shard(dim=1),)", res["placements"]
        assert res["placements"]["layers.0.proj.bias"] == "(Shard(dim=0),)", res["placements"]
        assert res["w1_local"] == (E, D, H // 4), res
        assert res["proj_local"] in {(D, 2), (D, 0)}, res
        if mode in ("aot_eager", "regions", "inductor"):
            assert res["counts"] == [{}] * 3, res["counts"]
        if mode in ("aot_eager", "regions"):
            # Nothing gathered saved for backward, the copies into the
            # parameter's own layout included ([Note: Layout copies of a
            # gathered parameter are recomputed] in passes/recompute.py).
            assert len(res["saved_gathered"]) >= 1 and not any(res["saved_gathered"]), res["saved_gathered"]
        elif mode == "blocks":
            assert res["counts"] == [{"all_gather": 2, "reduce_scatter": 2}] * 3, res["counts"]
        assert res["regions"] == (2 if mode == "regions" else 0), res["regions"]
        # (FSDP2 sums 4 ranks' gradients in gloo's order, not the rank order)
        assert res["fsdp2_worst"] < 1e-6 and res["ours_even_worst"] == 0.0, res  # (both eager)
        assert res["same_placements"] and res["vs_fsdp2"] < 1e-6, res
        if mode == "eager":
            assert res["dcp"] == 0.0 and res["dcp_dim0_placement"] == "(Shard(dim=0),)", res


def _bad_rank(rank: int, world: int) -> str:
    try:
        fully_shard(nn.Linear(3, 8), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_dim_smaller_than_the_group_is_refused() -> None:
    for msg in run_distributed(_bad_rank, 4, timeout=120):
        assert "Shard(1) for 'weight'" in msg and "dim 1 has 3 elements for a shard group of 4 ranks" in msg, msg


def _hsdp_meta_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = Model()
    with torch.device("meta"):
        model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=largest_dim)
    fully_shard(model, mesh=mesh, shard_placement_fn=largest_dim)
    model.to_empty(device="cpu")
    with torch.no_grad():  # each rank's piece, as torch's distribute_tensor cuts it
        for (_, p), r in zip(model.named_parameters(), ref.parameters()):
            p.copy_(distribute_tensor(r.detach(), p.device_mesh, p.placements))
    out = _train(rank, world, model, ref, model)
    out["w1"] = str(model.layers[0].w1.placements)
    return out


def test_hsdp_from_meta() -> None:
    """HSDP (2 replicas x 2 shards) built on meta, each rank's piece written
    with torch's ``distribute_tensor``: ``(Replicate(), Shard(2))`` for an
    expert weight, within 1e-6 of the reference after 3 steps (the replicas'
    all-reduce sums in another order than the reference)."""
    for res in run_distributed(_hsdp_meta_rank, 4, timeout=600):
        assert res["w1"] == "(Replicate(), Shard(dim=2))", res
        assert res["worst"] < 1e-6, res


def _tp_rank(rank: int, world: int) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    block = nn.Sequential(nn.Linear(8, 8))
    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel()})
    msgs = []
    fully_shard(block, mesh=mesh["dp"])  # (taken: [Note: FSDP over DTensor parameters])
    block(torch.ones(2, 8)).sum().backward()
    msgs.append(str(block[0].weight.placements))
    # One of our shards tied onto another module after fully_shard: another application's weight.
    embed, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    fully_shard(embed)
    head.weight = embed.weight
    fully_shard(head)
    try:
        head(torch.zeros(2, 4))
        msgs.append("no error")
    except ValueError as exc:
        msgs.append(str(exc))
    return msgs[0], msgs[1]


def test_tensor_parallel_parameters_are_not_another_applications() -> None:
    """A TP DTensor parameter under ``fully_shard`` is taken (FSDP over TP,
    tests/test_tensor_parallel.py), not seen as a weight another application
    owns (which it was once); one of our own shards tied onto another module
    still is that."""
    for tp, tied in run_distributed(_tp_rank, 2, timeout=120):
        assert tp == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", tp
        assert "already managed by another fully_shard" in tied, tied
