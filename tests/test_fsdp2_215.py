"""What torch 2.15's FSDP2 API adds, as a user calls it: ``dp_mesh_dims``,
torch's own policy classes, ``param_dtype_override_fn`` and the new
``FSDPModule`` methods (README.md, "FSDP2's arguments and methods"), each against a
single-process reference or the documented refusal, on 2 gloo ranks (4 for
``dp_mesh_dims`` with tensor parallelism)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_chunked_loss import Decoder, batch, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import compiled_fsdp
from compiled_fsdp import DataParallelMeshDims, fully_shard, get_fsdp_state
from compiled_fsdp.core import compat
from examples.torchtitan_pattern import chunked_loss

from _dist import run_distributed
from _parity import whole


def _mean_of_ranks(ref: nn.Module, world: int, step: int, run) -> None:  # noqa: ANN001
    """The reference's gradients: each rank's batch apart, summed in rank
    order and halved, as the reduce-scatter and the mean do."""
    summed = None
    for r in range(world):
        run(ref, *batch(step, r)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        ref.zero_grad(set_to_none=True)
    for p, g in zip(ref.parameters(), summed):
        p.grad = g / world


def _head_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The head called on its own after the model's forward, one backward."""
    logits = model.lm_head(model(tokens))
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _spmd_rank(rank: int, world: int, tp: int, backends: tuple[str, ...]) -> dict:
    """``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)`` with parameters that
    come as DTensors on that mesh, as torchtitan's ``full_dtensor`` backend
    makes them: ``Replicate()`` on ``dp_shard``; on ``tp`` (size ``tp``)
    ``up`` ``Shard(0)``, ``down`` ``Shard(1)``, the rest ``Replicate()``.
    Inputs are DTensors ``Shard(0)`` over ``dp_shard``; each data-parallel
    rank's loss is that of its own logits (so FSDP's mean over ranks is the
    reference's). torch's ``MixedPrecisionPolicy`` and ``OffloadPolicy``;
    3 AdamW steps; ours once per backend (``eager``: not compiled) and,
    where torch's FSDP2 takes ``dp_mesh_dims``, FSDP2 eager beside them."""
    import inspect

    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import OffloadPolicy as TorchOffload
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    dp = mesh["dp_shard"].get_local_rank()

    def build(shard_fn, dims) -> nn.Module:  # noqa: ANN001
        model = Decoder()
        for mname, m in model.named_modules():
            for name, p in [(n, p) for n, p in m._parameters.items() if p is not None]:
                on_tp = Shard(0) if mname.endswith(".up") else Shard(1) if mname.endswith(".down") else Replicate()
                m._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), on_tp]))
        kwargs = dict(mesh=mesh, dp_mesh_dims=dims(shard="dp_shard"), mp_policy=TorchMP(),
                      offload_policy=TorchOffload())
        shard_fn(model.tok, **kwargs)
        shard_fn([model.norm, model.lm_head], reshard_after_forward=False, **kwargs)
        for block in model.layers.values():
            shard_fn(block, **kwargs)
        shard_fn(model, **kwargs)
        return model

    def train(model: nn.Module, run: nn.Module, step: int) -> None:
        tokens, labels = batch(step, dp)
        logits = model.lm_head(run(DTensor.from_local(tokens, mesh, [Shard(0), Replicate()])))
        local = logits.redistribute(mesh, [Shard(0), Replicate()]).to_local()  # (this rank's batch, whole)
        nn.functional.cross_entropy(local.flatten(0, 1), labels.flatten()).backward()

    theirs, dims = None, DataParallelMeshDims
    if "dp_mesh_dims" in inspect.signature(fsdp2_shard).parameters:  # (torch's class: ours takes it too)
        from torch.distributed.fsdp import DataParallelMeshDims as dims

        theirs = build(fsdp2_shard, dims)
    ref = Decoder()
    ours = {b: build(fully_shard, dims) for b in backends}
    runs = {b: torch.compile(m, backend=b) if b != "eager" else m for b, m in ours.items()}
    models = [*ours.values(), ref] + ([theirs] if theirs is not None else [])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    worst = dict.fromkeys(backends, 0.0)
    vs_fsdp2 = dict.fromkeys(backends, 0.0)
    for step in range(3):
        for b, model in ours.items():
            train(model, runs[b], step)
        if theirs is not None:
            train(theirs, theirs, step)
        _mean_of_ranks(ref, world // tp, step, _head_loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for b, model in ours.items():
            full = {n: whole(p) for n, p in model.named_parameters()}
            worst[b] = max(worst[b], max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
            if theirs is not None:
                vs_fsdp2[b] = max(vs_fsdp2[b], max((full[n] - whole(p)).abs().max().item()
                                                   for n, p in theirs.named_parameters()))

    def placed(model: nn.Module) -> dict:
        return {n: (p.device_mesh.mesh_dim_names, str(p.placements)) for n, p in model.named_parameters()}

    return {"worst": worst, "vs_fsdp2": vs_fsdp2 if theirs is not None else None,
            "placements": {b: placed(m) for b, m in ours.items()},
            "fsdp2_placements": placed(theirs) if theirs is not None else None}


def test_dp_mesh_dims_and_torch_policies() -> None:
    """Bitwise to the reference and to FSDP2 (torch 2.15), placed as FSDP2
    places them; refused on torch 2.11 (below)."""
    if not compat.from_local_takes_grad_placements():
        with pytest.raises(Exception, match="grad_placements"):
            run_distributed(_spmd_rank, 2, 1, ("eager",))
        return
    for res in run_distributed(_spmd_rank, 2, 1, ("eager",)):
        assert res["worst"]["eager"] == 0.0 and res["vs_fsdp2"] in (None, {"eager": 0.0}), res
        placed = res["placements"]["eager"]
        assert placed["lm_head.weight"] == (("dp_shard", "tp"), "(Shard(dim=0), Replicate())"), res
        assert res["fsdp2_placements"] in (None, placed), res


def test_dp_mesh_dims_with_tensor_parallelism() -> None:
    """A (dp_shard 2, tp 2) mesh on 4 ranks: the parameters registered on it as
    FSDP2 places them (``up``'s rows split by both dims: ``_StridedShard``),
    trained eager and under ``aot_eager`` within 1e-5 of the single-process
    reference (tensor parallelism sums in another order: 1.1e-6 measured)
    and bitwise equal to FSDP2's eager run (torch 2.15). Refused on a torch
    whose ``DTensor.from_local`` takes no ``grad_placements`` (2.11)."""
    if not compat.from_local_takes_grad_placements():
        with pytest.raises(Exception, match="grad_placements"):
            run_distributed(_spmd_rank, 4, 2, ("eager",))
        return
    for res in run_distributed(_spmd_rank, 4, 2, ("eager", "aot_eager"), timeout=600):
        for backend in ("eager", "aot_eager"):
            assert res["worst"][backend] < 1e-5, res
            assert res["vs_fsdp2"] is None or res["vs_fsdp2"][backend] == 0.0, res
            placed = res["placements"][backend]
            assert placed["layers.0.up.weight"] == (("dp_shard", "tp"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
            assert placed["layers.0.down.weight"] == (("dp_shard", "tp"), "(Shard(dim=0), Shard(dim=1))"), res
            assert res["fsdp2_placements"] in (None, placed), res


def _finalize_rank(rank: int, world: int) -> dict:
    """torchtitan's chunked loss with ``set_manual_backward_finalization(True)``:
    five backwards, then ``finalize_backward()``: the last reduction is still
    in flight until then (no backward finished the iteration), and the
    gradients equal the automatic run's."""
    out: dict = {}
    for manual in (False, True):
        model = Decoder()
        shard(model)
        if manual:
            model.set_manual_backward_finalization(True)
        chunked_loss(model.lm_head, model(batch(0, rank)[0]), batch(0, rank)[1]).backward()
        if manual:
            out["before"] = bool(get_fsdp_state(model).ctx.pending_reduces)
            with pytest.raises(RuntimeError, match="after backward starts"):
                model.set_manual_backward_finalization(False)
            handle = model.finalize_backward(async_op=True)
            handle.wait()
            out["before"] = out["before"] and not get_fsdp_state(model).ctx.pending_reduces
        out[manual] = {n: whole(p.grad) for n, p in model.named_parameters()}
    out["diff"] = max((out[True][n] - g).abs().max().item() for n, g in out[False].items())
    # FSDP2's recipe for several backwards before one finalization: sync off
    # for them, on again before finalize_backward, which reduces the kept sum.
    for micro in (False, True):
        model = Decoder()
        shard(model)
        model.set_manual_backward_finalization(micro)
        model.set_requires_gradient_sync(not micro)
        for i in range(2):
            tokens, labels = batch(i, rank)
            nn.functional.cross_entropy(model.lm_head(model(tokens)).flatten(0, 1), labels.flatten()).backward()
        if micro:
            model.set_requires_gradient_sync(True)
            model.finalize_backward()
        out[("micro", micro)] = {n: whole(p.grad) for n, p in model.named_parameters()}
    out["micro"] = max((out[("micro", True)][n] - g).abs().max().item() for n, g in out[("micro", False)].items())
    return {"before": out["before"], "diff": out["diff"], "micro": out["micro"]}


def test_manual_backward_finalization() -> None:
    """Bitwise equal to the automatic run; with two micro-batches kept without
    sync, equal to syncing each (within rounding: the sum is reduced once
    instead of twice)."""
    for res in run_distributed(_finalize_rank, 2):
        assert res["before"] and res["diff"] == 0.0, res
        assert res["micro"] < 1e-6, res


class _TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _methods_rank(rank: int, world: int) -> dict:
    out: dict = {}
    # set_reduce_scatter_unused_params: rank 1 leaves ``b`` unused; zeros are
    # reduced for it, so both ranks reduce the same buffer.
    ref, model = _TwoBranches(), _TwoBranches()
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, use_b=rank == 0).square().sum().backward()
    grads = []
    for r in range(world):
        xr = torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
        ref(xr, use_b=r == 0).square().sum().backward()
        grads.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for n, p in ref.named_parameters()})
        ref.zero_grad(set_to_none=True)
    out["unused"] = max((whole(model.get_parameter(n).grad) - (g + grads[1][n]) / world).abs().max().item()
                        for n, g in grads[0].items())
    # set_keep_unsharded_storage: the bytes stay after reshard.
    dec = Decoder()
    shard(dec)
    block = dec.layers["0"]
    sizes = []
    for keep in (False, True):
        block.set_keep_unsharded_storage(keep)
        dec.lm_head(dec(batch(0, rank)[0])).sum().backward()
        sizes.append(get_fsdp_state(block).param_group.fsdp_params[0].unsharded.untyped_storage().size())
    out["kept"] = sizes[0] == 0 and sizes[1] > 0
    # param_dtype_override_fn: norms kept in fp32 while the rest is gathered in bf16.
    mp = compiled_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: p.dtype if p.dim() == 1 else None)
    dec = Decoder()
    fully_shard(dec.layers["0"].norm, mp_policy=mp)
    fully_shard(dec.layers["0"], mp_policy=mp)
    out["dtypes"] = [str(get_fsdp_state(m).param_group.fsdp_params[0].param_dtype)
                     for m in (dec.layers["0"].norm, dec.layers["0"])]
    try:
        fully_shard(dec.layers["1"], mp_policy=mp)  # a norm and linears: two dtypes in one group
    except ValueError as exc:
        out["mixed"] = str(exc)
    # Accepted and documented as no-ops; refused with a reason.
    dec.layers["0"].set_force_sum_reduction_for_comms(True)
    dec.layers["0"].set_allocate_memory_from_process_group_for_comm(True)
    dec.layers["0"].set_reduce_scatter_max_input_buffers(2)
    dec.layers["0"].set_separate_reduce_scatter_group(True)
    refused = {}
    for name, call in (("symm", lambda m: m.set_symm_mem_for_comm()),
                       ("custom", lambda m: m.set_custom_all_gather(object())),
                       ("hook", lambda m: m.set_all_reduce_hook(lambda t: None)),
                       ("buffers", lambda m: m.set_reduce_scatter_max_input_buffers(0))):
        try:
            call(dec.layers["0"])
        except (NotImplementedError, ValueError) as exc:
            refused[name] = type(exc).__name__
    out["refused"] = refused
    return out


def test_fsdp_module_methods_of_2_15() -> None:
    for res in run_distributed(_methods_rank, 2):
        assert res["unused"] == 0.0 and res["kept"], res
        assert res["dtypes"] == ["torch.float32", "torch.bfloat16"], res
        assert "several dtypes" in res["mixed"], res
        assert res["refused"] == {"symm": "NotImplementedError", "custom": "NotImplementedError",
                                  "hook": "NotImplementedError", "buffers": "ValueError"}, res


@pytest.mark.parametrize("bad", ["unknown dim", "no mesh"])
def test_dp_mesh_dims_errors(bad: str) -> None:
    for res in run_distributed(_bad_dims_rank, 2, bad):
        assert res, bad


def _bad_dims_rank(rank: int, world: int, bad: str) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    dims = DataParallelMeshDims(shard="fsdp" if bad == "unknown dim" else "dp_shard")
    with pytest.raises(ValueError, match="dp_mesh_dims") as info:
        fully_shard(nn.Linear(4, 4), mesh=mesh if bad == "unknown dim" else None, dp_mesh_dims=dims)
    return str(info.value)


def _optimizer_in_backward_rank(rank: int, world: int, how: str) -> dict:
    import copy

    from compiled_fsdp.tools.models import batch as gpt_batch
    from compiled_fsdp.tools.models import loss_fn
    from examples.gpt import GPT, GPTConfig

    compiled_fsdp.config.comm.block_regions = how == "regions"
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab=67, dim=24, n_layers=2, n_heads=2, seq=16))
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    fired: list[str] = []
    for name, p in model.named_parameters():
        opt = torch.optim.AdamW([p], lr=1e-2, foreach=False)

        def step(param: torch.Tensor, opt: torch.optim.Optimizer = opt, name: str = name) -> None:
            fired.append(name)
            opt.step()
            opt.zero_grad()

        p.register_post_accumulate_grad_hook(step)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    if how == "blocks":
        for block in model.layers:
            block.compile(backend="aot_eager")
    runner = torch.compile(model, backend="aot_eager") if how in ("whole", "regions") else model
    steps = 3
    for step in range(steps):
        tokens = gpt_batch(ref.cfg, 2, step)  # (the same on every rank: the mean is that gradient)
        loss_fn(runner(tokens), tokens).backward()
        loss_fn(ref(tokens), tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = {n: whole(p) for n, p in model.named_parameters()}
    diff = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    names = [n for n, _ in ref.named_parameters()]
    from collections import Counter

    counts = Counter(fired)
    return {"diff": diff, "fired": {n: counts[n] for n in names if counts[n] != steps},
            "grads_left": [n for n, p in model.named_parameters() if p.grad is not None]}


@pytest.mark.parametrize("how", ["eager", "whole", "regions", "blocks"])
def test_optimizer_in_backward(how: str) -> None:
    """FSDP2 2.15 runs a sharded parameter's post-accumulate-grad hooks once
    it sets the reduced gradient, so an optimizer in backward (one per
    parameter, stepping in the hook and zeroing the gradient) trains. Here
    every parameter's hook runs once per backward, in eager, with the model
    compiled whole (one graph, or its blocks compile regions) and with each
    block compiled on its own (``aot_eager``), and after 3 steps the
    parameters are bitwise the single-process reference's with one AdamW.
    Before, the eager runtime and the regions set ``.grad`` without running
    the hooks: the optimizer never stepped."""
    for res in run_distributed(_optimizer_in_backward_rank, 2, how, timeout=900):
        assert res["fired"] == {} and not res["grads_left"], res
        assert res["diff"] == 0.0, res
