"""Train a sharded model and a single-process unsharded reference side by side
(same seed, same batches) and measure how far apart they are."""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import compiled_fsdp
from compiled_fsdp.tools.check_worker import managed_params, max_diff

from _graphs import shard_shape


def in_regions(model: nn.Module) -> list[bool]:
    """Per sharded module (``explain()``'s order), whether it ran as a compile
    region ([Note: Blocks as compile regions] in compiled_fsdp/compile/regions.py)."""
    return [any("compile region" in u for u in r.units) for r in compiled_fsdp.explain(model)]


def reference_grads(ref: nn.Module, loss_of: Callable[[int], torch.Tensor], ranks: int) -> None:
    """The reference's gradients as the sharded job reduces them: each
    rank's batch apart (``loss_of(rank)``), summed in rank order, averaged."""
    summed = None
    for r in range(ranks):
        loss_of(r).backward()
        grads = [p.grad for p in ref.parameters()]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        ref.zero_grad(set_to_none=True)
    for p, g in zip(ref.parameters(), summed):
        p.grad = g / ranks


def run_parity(
    rank: int,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], None],
    make_batch: Callable[[int], tuple],
    loss_fn: Callable,
    steps: int = 3,
    lr: float = 1e-3,
    wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
    graph_counts: Optional[Callable[[], dict]] = None,
    after_step: Optional[Callable[[nn.Module], object]] = None,
    make_ref_batch: Optional[Callable[[int], tuple]] = None,
    prepare: Optional[Callable[[nn.Module], nn.Module]] = None,
    ref_forward: Optional[Callable[[nn.Module, tuple], torch.Tensor]] = None,
) -> dict:
    """Per step: |loss diff|, max |grad diff| and max |param diff| over all params,
    the eager collective counts of the sharded step, the in-graph ones when
    ``graph_counts`` reports them, and whatever ``after_step(model)`` returns.
    ``make_ref_batch`` gives the reference's batch when the ranks' batches
    differ (the global batch; default: the rank's own, the same on every rank);
    the loss difference is then not measured (the ranks' losses differ).
    ``prepare(ref)`` builds the sharded model another way (default: a deep copy
    of the reference, then ``shard``). ``ref_forward(ref, inputs)`` runs the
    reference (default: ``ref(*inputs)``)."""
    ref = build()
    if prepare is not None:
        model = prepare(ref)
    else:
        model = copy.deepcopy(ref)
        shard(model)
    managed = managed_params(model)
    runner = wrap(model) if wrap is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    named_ref = dict(ref.named_parameters())
    # torch.compile wrappers put "_orig_mod." into names; compare by the plain FQN.
    named = {n.replace("_orig_mod.", ""): p for n, p in model.named_parameters()}
    assert named.keys() == named_ref.keys(), (named.keys(), named_ref.keys())

    def local(name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        # (this rank's piece: by its place in the parameter's shard group, not in the world:
        # a replicate or HSDP job's ranks hold the same rows on every replica)
        fp = managed.get(id(named[name]))
        return t if t is None or fp is None else fp.local_of(t, fp.shard_rank)

    out = {"loss": [], "grad": [], "param": [], "counts": [], "bytes": [], "graph_counts": [], "after": []}
    for step in range(steps):
        inputs = make_batch(step)
        compiled_fsdp.reset_collective_counts()
        loss = loss_fn(runner(*inputs), *inputs)
        loss.backward()
        out["counts"].append(compiled_fsdp.collective_counts())
        out["bytes"].append(compiled_fsdp.collective_bytes())
        if graph_counts is not None:
            out["graph_counts"].append(graph_counts())
        if after_step is not None:
            out["after"].append(after_step(model))
        ref_inputs = make_ref_batch(step) if make_ref_batch is not None else inputs
        ref_out = ref_forward(ref, ref_inputs) if ref_forward is not None else ref(*ref_inputs)
        ref_loss = loss_fn(ref_out, *ref_inputs)
        ref_loss.backward()
        out["loss"].append(0.0 if make_ref_batch is not None else abs(loss.item() - ref_loss.item()))
        out["grad"].append(max(max_diff(named[n].grad, local(n, p.grad)) for n, p in named_ref.items()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["param"].append(max(max_diff(named[n].detach(), local(n, p.detach())) for n, p in named_ref.items()))
    return out


def assert_close(result: dict, tol: float) -> None:
    for key in ("loss", "grad", "param"):
        worst = max(result[key])
        assert worst <= tol, f"{key} differs from the reference by {worst:.3e} (> {tol:.1e}): {result[key]}"


def _all_gather_flat(flat: torch.Tensor, world: int) -> torch.Tensor:
    out = flat.new_empty((world * flat.numel(),))
    dist.all_gather_into_tensor(out, flat)
    return out.view(world, -1)


def _whole_by_positions(t: DTensor) -> torch.Tensor:
    """``t`` whole, for any placements over a mesh of every rank: each rank's
    values and the flat positions they hold in ``t`` (an index tensor
    sharded as ``t`` is, on each rank alone: ``src_data_rank=None``),
    gathered by the eager all-gather, padded to the largest local part."""
    world = dist.get_world_size()
    assert t.device_mesh.size() == world, "a mesh of every rank"
    local = t.to_local().detach().reshape(-1)
    positions = torch.arange(t.numel(), device=local.device).view(t.shape)
    mine = distribute_tensor(positions, t.device_mesh, t.placements, src_data_rank=None).to_local().reshape(-1)
    counts = _all_gather_flat(torch.tensor([local.numel()], device=local.device), world).view(-1).tolist()
    width = max(counts)
    values = _all_gather_flat(torch.cat([local, local.new_zeros(width - local.numel())]), world)
    where = _all_gather_flat(torch.cat([mine, mine.new_zeros(width - mine.numel())]), world)
    full = local.new_empty((t.numel(),))
    for r, n in enumerate(counts):
        full[where[r, :n]] = values[r, :n]
    return full.view(t.shape)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` (detached), gathered by torch's eager all-gather
    where ``t`` is sharded on one mesh dim and replicated on the others (a
    collective: every rank calls it). DTensor's own gather is the functional
    op, whose work's name gloo's two worker threads race on ([Note:
    All-gathers on gloo] in compiled_fsdp/core/comm.py): a rank of this
    suite died of it in CI, gathering every parameter after each step.
    Other placements (tensor parallelism's strided shards) are gathered by
    the same op, with the positions each rank holds (``_whole_by_positions``):
    DTensor's own ``full_tensor`` there issued two functional all-gathers,
    and a rank of this suite died of gloo's race in CI (``malloc(): unaligned
    tcache chunk detected``, test_fsdp2_215.py's tensor-parallel test)."""
    if not isinstance(t, DTensor):
        return t.detach()
    sharded = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard:
        return _whole_by_positions(t)
    mesh_dim, dim = sharded[0][0], sharded[0][1].dim
    group = t.device_mesh.get_group(mesh_dim)
    world = group.size()
    counts = [shard_shape([t.shape[dim]], world, r)[0] for r in range(world)]
    local = t.to_local()
    plain = torch.zeros((max(counts), *local.movedim(dim, 0).shape[1:]), dtype=local.dtype, device=local.device)
    plain[: local.shape[dim]].copy_(local.detach().movedim(dim, 0))  # (a subclass's values into a plain tensor)
    out = plain.new_empty((world * plain.shape[0], *plain.shape[1:]))
    dist.all_gather_into_tensor(out, plain, group=group)
    rows = out.chunk(world)
    return torch.cat([rows[r][: counts[r]] for r in range(world)]).movedim(0, dim)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a sharded (or replicated) model gathered whole
    (``whole``), by its name in the model without ``torch.compile``'s
    wrapper (a collective: every rank calls it)."""
    return {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}


def full_diff(full: dict[str, torch.Tensor], ref: nn.Module) -> float:
    """max |full - ref| over the reference's parameters."""
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


def global_batch_steps(rank: int, world: int, model: nn.Module, run: Callable, ref: nn.Module,
                       steps: int = 3) -> list[dict[str, int]]:
    """``steps`` AdamW steps of ``run`` (``model``, sharded, maybe compiled)
    on this rank's batch of the tiny GPT's tokens, and of ``ref`` on the
    global batch; each step's eager collective counts."""
    from compiled_fsdp.tools.models import batch, loss_fn

    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    counts = []
    for step in range(steps):
        compiled_fsdp.reset_collective_counts()
        tokens = [batch(ref.cfg, 2, 100 * step + r) for r in range(world)]
        loss_fn(run(tokens[rank]), tokens[rank]).backward()
        (sum(loss_fn(ref(t), t) for t in tokens) / world).backward()
        counts.append(compiled_fsdp.collective_counts())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return counts
