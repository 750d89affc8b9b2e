"""Plain parameters annotated with spmd_types, as torchtitan's default SPMD
backend leaves them, under ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``
with tensor parallelism ([Note: spmd_types parameters] in
runtime/annotated.py): a (dp_shard 2, tp 2) mesh on 4 gloo ranks, beside
torch's FSDP2 and a single-process reference. Runs where torch reads the
annotations (2.15 with the ``spmd_types`` package, which the ``titan``
extra brings); tests/test_torchtitan.py trains torchtitan's model with that
backend."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from compiled_fsdp.core import compat

from _dist import run_distributed
from _parity import whole

pytest.importorskip("spmd_types")
if compat.spmd_types_package() is None:
    pytest.skip("this torch's FSDP2 reads no spmd_types annotations", allow_module_level=True)

D, H, TP = 16, 32, 2


class ColumnParallel(nn.Module):
    """``relu((x * g) @ w.T) * c``: ``w``'s rows and ``c`` split over ``tp``
    (this rank's piece of the full tensors), ``g`` whole on every rank; each
    ``tp`` rank's output is its own columns, so ``g``'s gradient is partial
    over ``tp`` (annotated ``R``: backward ``P``) and ``w``'s and ``c``'s are
    their own (``S(0)``)."""

    def __init__(self, tp: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        g, w, c = 1 + 0.1 * torch.randn(D), torch.randn(H, D) / 4, torch.randn(H)
        rows = slice(tp_rank * H // tp, (tp_rank + 1) * H // tp)
        self.g = nn.Parameter(g)
        self.w = nn.Parameter(w[rows].clone())
        self.c = nn.Parameter(c[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x * self.g) @ self.w.t()) * self.c


def _batch(step: int, dp: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 * step + dp))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() / 4


def _rank(rank: int, world: int, backends: tuple[str, ...]) -> dict:
    """Ours once per backend and FSDP2 eager, 3 SGD steps (SGD: a gradient
    missing tensor parallelism's sum changes the step, where Adam's
    normalization could hide a scale); then the refusals."""
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from compiled_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    dp, dims = mesh["dp_shard"].get_local_rank(), DataParallelMeshDims(shard="dp_shard")
    dp_group, tp_group = mesh.get_group("dp_shard"), mesh.get_group("tp")

    def build(shard_fn) -> nn.Module:  # noqa: ANN001
        model = ColumnParallel(TP, mesh["tp"].get_local_rank())
        spmd.assert_type(model.g, {dp_group: spmd.R, tp_group: spmd.R})
        spmd.assert_type(model.w, {dp_group: spmd.R, tp_group: spmd.S(0)})
        spmd.assert_type(model.c, {dp_group: spmd.R, tp_group: spmd.S(0)})
        shard_fn(model, mesh=mesh, dp_mesh_dims=dims)
        return model

    models = {b: build(fully_shard) for b in backends}
    models["fsdp2"] = theirs = build(fsdp2_shard)
    theirs.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
    runs = {b: torch.compile(m, backend=b) if b not in ("eager", "fsdp2") else m for b, m in models.items()}
    ref = ColumnParallel()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*models.values(), ref)]
    for step in range(3):
        for run in runs.values():
            _loss(run(_batch(step, dp))).backward()  # (FSDP averages over dp_shard)
        for d in range(world // TP):
            (_loss(ref(_batch(step, d))) / (world // TP)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = {b: {n: whole(p) for n, p in m.named_parameters()} for b, m in models.items()}
    out: dict = {
        "worst": {b: max((f[n] - p).abs().max().item() for n, p in ref.named_parameters()) for b, f in full.items()},
        "vs_fsdp2": {b: max((f[n] - full["fsdp2"][n]).abs().max().item() for n in f) for b, f in full.items()},
        "placements": {b: {n: str(p.placements) for n, p in m.named_parameters()} for b, m in models.items()},
    }
    out["typed"] = {b: _typechecked_step(models[b], mesh, dp) for b in ("eager", "fsdp2")}
    out["hsdp"] = _hsdp_on_flattened_dp(world)
    bad = ColumnParallel(TP, mesh["tp"].get_local_rank())
    spmd.assert_type(bad.w, {dp_group: spmd.R, tp_group: spmd.S(0)})
    with pytest.raises(ValueError, match="need the full SPMD mesh"):
        fully_shard(bad, mesh=mesh["dp_shard"])
    bad = ColumnParallel(TP, mesh["tp"].get_local_rank())
    spmd.assert_type(bad.w, {dp_group: spmd.I, tp_group: spmd.S(0)})
    with pytest.raises(ValueError, match="needs R there"):
        fully_shard(bad, mesh=mesh, dp_mesh_dims=dims)
    bad = ColumnParallel(TP, mesh["tp"].get_local_rank())
    spmd.assert_type(bad.w, {dp_group: spmd.R})
    with pytest.raises(ValueError, match="no spmd_types annotation on the dim 'tp'"):
        fully_shard(bad, mesh=mesh, dp_mesh_dims=dims)
    return out


def _hsdp_on_flattened_dp(world: int) -> dict:
    """torchtitan's HSDP under its default backend: parameters annotated
    ``R`` on the flattened ``dp`` axis (dp_replicate x dp_shard), which is
    no dim of the mesh but lies within its data-parallel dims. Ours and
    FSDP2 take it, train 2 SGD steps and a type-checked one; returns the
    largest difference between them and both output types."""
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from compiled_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    flat = mesh._flatten("dp")
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    models = {}
    for name, shard_fn in (("ours", fully_shard), ("fsdp2", fsdp2_shard)):
        model = ColumnParallel()
        for p in model.parameters():
            spmd.assert_type(p, {flat.get_group(): spmd.R})
        shard_fn(model, mesh=mesh, dp_mesh_dims=dims)
        models[name] = model
    models["fsdp2"].set_force_sum_reduction_for_comms(True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models.values()]
    dp = flat.get_local_rank()
    for step in range(2):
        for m in models.values():
            _loss(m(_batch(step, dp))).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    typed = {}
    for name, m in models.items():
        x = _batch(2, dp)
        spmd.assert_type(x, {flat.get_group(): spmd.S(0)})
        typed[name] = _typecheck(m, mesh, x)
    diff = max((whole(p) - whole(q)).abs().max().item()
               for p, q in zip(models["ours"].parameters(), models["fsdp2"].parameters()))
    return {"diff": diff, "typed": typed}


def _typecheck(model: nn.Module, mesh, x: torch.Tensor) -> str:  # noqa: ANN001
    """One forward and backward of ``model`` on the annotated ``x`` under
    spmd_types' type checking; the output's local type."""
    import spmd_types as spmd
    from spmd_types.checker import typecheck

    with spmd.set_current_mesh(mesh), typecheck(local=False):
        out = model(x)
        loss = _loss(out)
    loss.backward()
    model.zero_grad()
    return str(spmd.get_local_type(out))


def _typechecked_step(model: nn.Module, mesh, dp: int) -> str:  # noqa: ANN001
    """A forward and backward under spmd_types' type checking, the input
    annotated ``S(0)`` over ``dp_shard``: the parameters the module reads
    carry their annotations (without them the checker raises "missing axis"),
    and the hooks' own work is not checked. The output's local type."""
    import spmd_types as spmd

    x = _batch(3, dp)
    spmd.assert_type(x, {mesh.get_group("dp_shard"): spmd.S(0), mesh.get_group("tp"): spmd.R})
    return _typecheck(model, mesh, x)


def test_spmd_types_annotations() -> None:
    """Registered as FSDP2 registers them (``w``'s rows split by both dims:
    ``_StridedShard``), trained eager and under ``aot_eager`` within 1e-5 of
    the single-process reference (4.2e-6 measured: tensor parallelism sums
    ``g``'s gradient in another order) and bitwise equal to FSDP2. Before
    this, ours sharded the annotated pieces as whole parameters: ``w``'s
    full tensor had half its rows, and ``g`` missed tensor parallelism's sum
    (12.5 from the reference when only that sum is dropped). An annotation
    other than ``R`` on the data-parallel dim, or none on ``tp``, is
    refused, and so are annotations without ``dp_mesh_dims`` (as FSDP2
    refuses them). Under spmd_types' type checking a step runs as FSDP2's
    does. torchtitan's HSDP (annotated on the flattened ``dp`` axis, within
    the mesh's data-parallel dims) trains bitwise as FSDP2's, type checked too."""
    for res in run_distributed(_rank, 4, ("eager", "aot_eager"), timeout=600):
        for backend in ("eager", "aot_eager", "fsdp2"):
            assert res["worst"][backend] < 1e-5, res
            assert res["vs_fsdp2"][backend] == 0.0, res
            assert res["placements"][backend] == res["placements"]["fsdp2"], res
        assert res["placements"]["eager"]["w"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", res
        assert res["typed"]["eager"] == res["typed"]["fsdp2"] == "{mesh_dp_shard: V, mesh_tp: V}", res
        assert res["hsdp"]["diff"] == 0.0 and res["hsdp"]["typed"]["ours"] == res["hsdp"]["typed"]["fsdp2"], res
