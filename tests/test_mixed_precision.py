"""Mixed precision: FSDP2's ``MixedPrecisionPolicy`` on both paths, against a
single-process reference whose forward uses bf16 copies of its fp32
parameters. See [Note: Mixed precision] in compiled_fsdp/runtime/policy.py."""
from __future__ import annotations

from typing import Callable, Optional, Union

import pytest
import torch
import torch.nn as nn

from compiled_fsdp import MixedPrecisionPolicy, fully_shard
from compiled_fsdp.core import compat
from compiled_fsdp.tools.check_worker import shard_specs

from _dist import run_distributed
from _graphs import AG, GraphCapture, one_graph, saved_gathered
from _models import gpt_case
from _parity import assert_close, run_parity, whole

BF16 = torch.bfloat16


class _Bf16Copy(torch.autograd.Function):
    """A bf16 copy whose gradient autograd hands over as produced (an fp32 one
    unrounded, two bf16 ones added in bf16): FSDP2 2.15's ``grad_dtype`` on
    its unsharded parameters during a backward."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.set_output_grad_dtype(None)
        return p.to(BF16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


def _bf16_forward(ref: nn.Module, inputs: tuple, grads_unrounded: Union[bool, Callable[[str], bool]] = False,
                  ) -> torch.Tensor:
    """The reference: one bf16 copy of each fp32 parameter (a tied weight is one
    parameter, so one copy), the same inputs. ``grads_unrounded`` (for all
    parameters, or those whose name it accepts): the copies take their
    gradients as autograd produced them (eager on torch 2.15, [Note: Mixed
    precision]); else rounded to bf16, as a compiled graph does."""
    def unrounded(name: str) -> bool:
        return grads_unrounded(name) if callable(grads_unrounded) else grads_unrounded

    params = {n: _Bf16Copy.apply(p) if unrounded(n) else p.to(BF16) for n, p in ref.named_parameters()}
    return torch.func.functional_call(ref, params, inputs)


def _shard(policy: MixedPrecisionPolicy):
    def shard(model: nn.Module) -> None:
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    return shard


def _gathered_bytes(capture: GraphCapture) -> int:
    """Bytes this rank puts into the all-gathers of the forward graph."""
    return sum(n.args[0].meta["val"].numel() * n.args[0].meta["val"].element_size()
               for n in capture.forward[-1].graph.nodes if n.op == "call_function" and n.target is AG)


def _parity_rank(rank: int, world: int, backend: Optional[str], reduce_dtype: Optional[torch.dtype]) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    build, make_batch, loss = gpt_case(True)  # tied embedding, ranks hold uneven rows
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    capture = GraphCapture() if backend == "aot_eager" else None
    wrap = None
    if backend is not None:
        wrap = lambda m: torch.compile(m, backend=capture.backend if capture else backend, fullgraph=True)  # noqa: E731
    unrounded = backend is None and compat.grads_in_reduce_dtype()
    res = run_parity(
        rank, build, _shard(policy), make_batch, loss, wrap=wrap,
        ref_forward=lambda ref, inputs: _bf16_forward(ref, inputs, unrounded),
        after_step=lambda m: (
            {str(p.dtype) for p in m.parameters()} | {str(p.grad.dtype) for p in m.parameters()},
            sum(s.shard_numel for s in shard_specs(m).values()),
        ),
    )
    if capture is not None:
        res["graph_gather_bytes"] = _gathered_bytes(capture)
        res["saved_gathered"] = [saved_gathered(fw) for fw in capture.forward]
        res["gather_dtypes"] = sorted({str(n.args[0].meta["val"].dtype) for g in capture.forward
                                       for n in g.graph.nodes if n.target is AG})
    if backend is None:  # the same step in full precision, for the bytes it gathers
        full = run_parity(rank, build, _shard(MixedPrecisionPolicy()), make_batch, loss, steps=1)
        res["fp32_bytes"] = full["bytes"][0]
    return res


@pytest.mark.parametrize("backend,reduce_dtype", [
    (None, torch.float32), (None, None), ("aot_eager", torch.float32), ("aot_eager", None),
])
def test_bf16_matches_a_bf16_reference(backend: Optional[str], reduce_dtype: Optional[torch.dtype]) -> None:
    """Eager and aot_eager bitwise equal to the reference, reducing in fp32 or in
    bf16 (the ranks see the same batch, so the rank sum and the division by 2
    are exact in either). Parameters, gradients and so the optimizer state stay
    fp32. The gathers move bf16: half the bytes of the fp32 run, and in the
    forward graph each rank's padded shard elements at 2 bytes each (fp32: 4).
    With reshard after forward the
    forward saves no gathered (bf16) parameter."""
    for res in run_distributed(_parity_rank, 2, backend, reduce_dtype, timeout=600):
        assert_close(res, 0.0)
        dtypes, shard_numel = res["after"][0]
        assert dtypes == {"torch.float32"}
        if backend is None:
            for bf16, fp32 in zip(res["bytes"], [res["fp32_bytes"]] * 3):
                assert bf16["all_gather"] * 2 == fp32["all_gather"]
                # (without reduce_dtype: the parameter's own dtype on 2.15, bf16 before)
                halves = reduce_dtype is None and not compat.grads_in_reduce_dtype()
                assert bf16["reduce_scatter"] * (2 if halves else 1) == fp32["reduce_scatter"]
        else:
            assert res["counts"] == [{}] * 3
            assert res["gather_dtypes"] == ["torch.bfloat16"]
            assert res["saved_gathered"] and not any(res["saved_gathered"])
            assert res["graph_gather_bytes"] == shard_numel * 2  # every module's shard, once


def test_bf16_inductor_is_close() -> None:
    """Inductor computes bf16 pointwise math in fp32 and fuses it: close, not
    bitwise. The bounds are those of Inductor itself: the *unsharded* reference
    under torch.compile differs from it in eager by one bf16 ulp of the loss
    (0.125 at ~20), up to 0.012 in gradients and 0.004 in parameters over the
    same 3 steps (measured 2026-11-23); the sharded model gets 2x that room."""
    for res in run_distributed(_parity_rank, 2, "inductor", torch.float32, timeout=900):
        assert res["counts"] == [{}] * 3
        assert max(res["loss"]) <= 0.25 and max(res["grad"]) <= 0.025 and max(res["param"]) <= 0.008, res


class _WithHead(nn.Module):
    """A decoder whose forward ends with its head."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder(tokens))


def _vs_fsdp2_rank(rank: int, world: int, reduce_dtype: Optional[torch.dtype], tied: bool) -> dict:
    """Ours and torch's FSDP2, eager, bf16 compute on a decoder with RMSNorms
    (on the CPU its bf16 weight meets an fp32 activation, so its gradient comes
    out of autograd in fp32), sharded as torchtitan shards it, each rank its
    own batches, 3 AdamW steps. ``tied``: the head's weight is the
    embedding's (two bf16 gradients), one group ``[tok, norm, head]`` as
    torchtitan makes it."""
    from test_chunked_loss import Decoder, batch
    from torch.distributed.fsdp import FSDPModule as TorchModule
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from examples.torchtitan_pattern import shard_like_torchtitan

    models = []
    for shard_fn, policy in ((fully_shard, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)),
                             (fsdp2_shard, TorchMP(param_dtype=BF16, reduce_dtype=reduce_dtype))):
        model = Decoder()
        if tied:
            model = _WithHead(model)
            dec = model.decoder
            dec.lm_head.weight = dec.tok.weight
            shard_fn([dec.tok, dec.norm, dec.lm_head], mp_policy=policy)
            for block in dec.layers.values():
                shard_fn(block, mp_policy=policy)
            shard_fn(model, mp_policy=policy)
        else:
            shard_like_torchtitan(shard_fn, model, model.tok, list(model.layers.values()), model.norm,
                                  model.lm_head, mp_policy=policy)
        models.append(model)
    for m in models[1].modules():
        if isinstance(m, TorchModule):
            m.set_force_sum_reduction_for_comms(True)  # (gloo has no AVG or PREMUL_SUM)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        for model in models:
            tokens, labels = batch(step, rank)
            logits = model(tokens) if tied else model.lm_head(model(tokens))
            nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ours, theirs = ({n: whole(p) for n, p in m.named_parameters()} for m in models)
    return {n: (ours[n] - theirs[n]).abs().max().item() for n in ours}


@pytest.mark.parametrize("reduce_dtype,tied", [(torch.float32, False), (None, False), (torch.float32, True)],
                         ids=["fp32", "none", "tied"])
def test_grads_in_reduce_dtype(reduce_dtype: Optional[torch.dtype], tied: bool) -> None:
    """Eager with bf16 compute is bitwise equal to the installed torch's FSDP2,
    with and without ``reduce_dtype``: on 2.15 both take the norms' fp32
    gradients unrounded and reduce in fp32 without ``reduce_dtype``; before,
    both round to bf16 and reduce in it ([Note: Mixed precision]). The old rule
    on 2.15 left every parameter apart (up to 1.5e-2 after 3 steps). A tied
    weight's two bf16 gradients add in bf16, as on FSDP2's leaf."""
    for diffs in run_distributed(_vs_fsdp2_rank, 2, reduce_dtype, tied, timeout=300):
        assert len(diffs) == (11 if tied else 12) and set(diffs.values()) == {0.0}, diffs


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _io_rank(rank: int, world: int, backend: Optional[str]) -> dict:
    """Float inputs are cast to bf16 by the fully sharded module that takes them
    (the body, sharded on its own; the root's policy does not cast), and the
    root's output comes back in fp32 (the root's policy has an output_dtype, the
    body's has none, so the head gets bf16)."""
    inner = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    # The root does not cast its inputs, so the body's fp32 input meets a bf16
    # weight unless the body's own hook casts it.
    outer = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32,
                                 cast_forward_inputs=False)

    def shard(model: nn.Module) -> None:
        fully_shard(model.body, mp_policy=inner)
        fully_shard(model, mp_policy=outer)

    def ref_forward(ref: nn.Module, inputs: tuple) -> torch.Tensor:
        return _bf16_forward(ref, (inputs[0].to(BF16),)).float()

    def make_batch(step: int) -> tuple:
        return (torch.randn(5, 6, generator=torch.Generator().manual_seed(step)),)

    outputs = []

    def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        outputs.append(out.dtype)
        return out.square().mean()

    wrap = (lambda m: torch.compile(m, backend=backend, fullgraph=True)) if backend else None
    res = run_parity(rank, _MLP, shard, make_batch, loss, wrap=wrap, ref_forward=ref_forward)
    res["out_dtypes"] = sorted({str(d) for d in outputs})
    return res


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_inputs_and_outputs_are_cast(backend: Optional[str]) -> None:
    for res in run_distributed(_io_rank, 2, backend, timeout=300):
        assert_close(res, 0.0)
        assert res["out_dtypes"] == ["torch.float32"]


def _bad_rank(rank: int, world: int) -> list[str]:
    msgs = []
    try:
        MixedPrecisionPolicy(param_dtype=torch.int32)
    except ValueError as exc:
        msgs.append(str(exc))
    try:  # a wrong type on one rank only: every rank raises, none waits
        fully_shard(nn.Linear(4, 4), mp_policy="bf16" if rank == 1 else None)
    except TypeError as exc:
        msgs.append(str(exc))
    mixed = nn.Linear(4, 4)  # an integer parameter next to float ones: one bucket cannot carry both
    mixed.register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    try:
        fully_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    except ValueError as exc:
        msgs.append(str(exc))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    for target in (model[0], nn.Linear(2, 2)):
        try:
            target.set_requires_gradient_sync(False)
        except (TypeError, AttributeError) as exc:
            msgs.append(str(exc))
    two = nn.Linear(4, 4)  # fp32 and bf16 parameters gathered in bf16, no reduce_dtype
    two.bias = nn.Parameter(torch.zeros(4, dtype=BF16))
    try:
        fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    except ValueError as exc:
        msgs.append(str(exc))
    return msgs


def test_bad_input_is_a_clear_error_on_every_rank() -> None:
    for msgs in run_distributed(_bad_rank, 2, timeout=120):
        # (torch 2.15 reduces each in its parameter's dtype: two, refused as FSDP2 refuses them)
        assert len(msgs) == (6 if compat.grads_in_reduce_dtype() else 5), msgs
        assert "param_dtype must be a floating-point torch.dtype" in msgs[0]
        assert "mp_policy must be a compiled_fsdp.MixedPrecisionPolicy" in msgs[1]
        assert "found on rank 1" in msgs[1]
        assert "communicated in several dtypes" in msgs[2] and "'count' (torch.int64)" in msgs[2]
        assert "was not passed to fully_shard" in msgs[3]
        assert "set_requires_gradient_sync" in msgs[4]  # a module nothing touched: Python's own
        assert len(msgs) == 5 or ("reduced in several dtypes" in msgs[5] and "'bias' (torch.bfloat16)" in msgs[5])
