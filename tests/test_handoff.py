"""Blocks compiled on their own hand the next block's gather to its graph (see
[Note: Gathers handed to the next block's graph] in
compiled_fsdp/compile/entry.py): what is specific to that handoff, each against
the single-process reference after 3 AdamW steps. The pattern itself (graph
reuse, where each collective runs) is tests/test_block_compile.py."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from test_mixed_precision import _bf16_forward

import compiled_fsdp
from compiled_fsdp import MixedPrecisionPolicy, fully_shard
from compiled_fsdp.core import compat
from examples.gpt import GPT, GPTConfig

from _dist import run_distributed
from _models import gpt_case
from _parity import assert_close, run_parity, whole


class RoutedGPT(GPT):
    """The tiny GPT whose forward runs its blocks in the order ``route`` (a
    class attribute, so the reference and the sharded model follow it)."""

    route: tuple[int, ...] = (0, 1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for i in self.route:
            x = self.layers[i](x)
        return self.head(self.norm(x))


def _routed() -> RoutedGPT:
    torch.manual_seed(0)
    return RoutedGPT(GPTConfig(vocab=67, dim=24, n_layers=3, n_heads=2, seq=16))


def _shard(policy: Optional[MixedPrecisionPolicy] = None, reshard: bool = True):
    def shard(model: torch.nn.Module) -> None:
        for block in model.layers:
            fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy)

    return shard


def _per_block(backend: str):
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        for block in model.layers:
            block.compile(backend=backend)
        return model

    return wrap


# Step 0 runs the blocks against the model's order (the first step's guess),
# step 1 in order, step 2 skips layers.1, which the recorded order predicts.
ROUTES = [(2, 1, 0), (0, 1, 2), (0, 2)]


def _routes_rank(rank: int, world: int) -> dict:
    _, make_batch, loss = gpt_case(False)

    def batch(step: int) -> tuple:
        RoutedGPT.route = ROUTES[step]
        return make_batch(step)

    def no_grad(model: torch.nn.Module) -> list[str]:
        return sorted({n.split(".")[1] for n, p in model.named_parameters()
                       if p.grad is None and n.startswith("layers.")})

    return run_parity(rank, _routed, _shard(), batch, loss, steps=3, wrap=_per_block("aot_eager"),
                      after_step=no_grad)


def test_order_other_than_predicted_and_a_skipped_block() -> None:
    """Bitwise equal to the reference while the prediction of the next block is
    wrong: in the first step the blocks run in reverse (blocks handed nothing
    gather themselves; gathers handed to blocks that already ran are dropped),
    and in the third layers.1, predicted from the second step, does not run:
    the gather handed to it is dropped, its issuer's backward reduces zeros,
    and its parameters end the step with no gradient, as in the reference
    (AdamW then leaves them alone; a zero gradient would decay them)."""
    for res in run_distributed(_routes_rank, 2, timeout=600):
        assert_close(res, 0.0)
        assert res["after"] == [[], [], ["1"]]  # the blocks without a gradient, per step


def _eager_root_bf16(ref: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    """The bf16 reference for blocks compiled on their own under an eager root:
    the root's parameters take their gradients as the eager runtime does (as
    produced, on torch 2.15), the blocks' rounded to bf16 as their graphs do
    ([Note: Mixed precision] in compiled_fsdp/runtime/policy.py)."""
    eager = compat.grads_in_reduce_dtype()
    return _bf16_forward(ref, inputs, lambda name: eager and not name.startswith("layers."))


def _bf16_rank(rank: int, world: int, reduce_dtype: Optional[torch.dtype]) -> dict:
    build, make_batch, loss = gpt_case(True)  # tied embedding (the root's), uneven rows
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    return run_parity(rank, build, _shard(policy), make_batch, loss, wrap=_per_block("aot_eager"),
                      ref_forward=_eager_root_bf16)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_handoff(reduce_dtype: Optional[torch.dtype]) -> None:
    """bf16 gathers handed over, gradients packed in bf16 by the reading block
    and cast to the reduce dtype by the issuer before the reduce: bitwise equal
    to the bf16 reference, as the eager runtime (which casts each gradient
    before packing it)."""
    for res in run_distributed(_bf16_rank, 2, reduce_dtype, timeout=600):
        assert_close(res, 0.0)


def _eager_backend_rank(rank: int, world: int) -> dict:
    build, make_batch, loss = gpt_case(False)
    return run_parity(rank, build, _shard(), make_batch, loss, wrap=_per_block("eager"))


def test_markers_run_eagerly() -> None:
    """``backend="eager"`` lowers nothing: the handoff ops' own implementations
    run (the gather handed over unwaited, the gradient packed, the issuer's
    reduce), bitwise equal to the reference. Every gather and reduce is one
    bucketed eager collective: the root's, and one per block (the first
    block's issued by the root, the second's by the first block's graph)."""
    for res in run_distributed(_eager_backend_rank, 2, timeout=600):
        assert_close(res, 0.0)
        assert res["counts"] == [{"all_gather": 3, "reduce_scatter": 3}] * 3


def _keep_rank(rank: int, world: int) -> dict:
    from _graphs import AG, GraphCapture, count

    build, make_batch, loss = gpt_case(False)
    capture = GraphCapture()
    res = run_parity(rank, build, _shard(reshard=False), make_batch, loss, wrap=_per_block(capture.backend),
                     graph_counts=capture.take_runtime)
    res["backward_gathers"] = [count(g, AG) for g in capture.backward]
    return res


def test_blocks_that_keep_their_parameters() -> None:
    """``reshard_after_forward=False``: the backward reads the gather handed
    to the block (saved from forward) and gathers nothing; bitwise equal to
    the reference. One backward graph: the last block hands its gather to a
    stand-in ([Note: A stand-in for the last block's next])."""
    for res in run_distributed(_keep_rank, 2, timeout=600):
        assert_close(res, 0.0)
        assert res["backward_gathers"] == [0]
        assert res["graph_counts"] == [{"fw_all_gather": 1, "bw_reduce_scatter": 1}] * 3


def _unused_rank(rank: int, world: int) -> dict:
    base, make_batch, loss = gpt_case(False)

    def build() -> torch.nn.Module:
        model = base()
        for block in model.layers:  # in the block's bucket, never read by its forward
            block.unused = torch.nn.Parameter(torch.randn(3))
        return model

    def no_grad(model: torch.nn.Module) -> list[str]:
        return sorted(n for n, p in model.named_parameters() if p.grad is None)

    return run_parity(rank, build, _shard(), make_batch, loss, wrap=_per_block("aot_eager"),
                      after_step=no_grad)


def test_parameter_the_block_never_reads() -> None:
    """A parameter in a block's bucket that its forward never reads: the
    handed-over gather's backward reduces a zero for it, and it ends the step
    with no gradient, as in the reference and the eager runtime (AdamW leaves
    it alone; a zero gradient would decay it)."""
    for res in run_distributed(_unused_rank, 2, timeout=600):
        assert_close(res, 0.0)
        assert res["after"] == [["layers.0.unused", "layers.1.unused"]] * 3


def _off_rank(rank: int, world: int) -> dict:
    from compiled_fsdp import config

    from _graphs import GraphCapture

    build, make_batch, loss = gpt_case(False)
    capture = GraphCapture()

    def shard(model: torch.nn.Module) -> None:
        config.comm.hand_over_gathers = False
        try:
            _shard()(model)
        finally:
            config.comm.hand_over_gathers = True  # (read at fully_shard: changing it later changes nothing)

    return run_parity(rank, build, shard, make_batch, loss, wrap=_per_block(capture.backend),
                      graph_counts=capture.take_runtime)


def test_handoff_off_at_fully_shard() -> None:
    """``config.comm.hand_over_gathers = False`` at ``fully_shard`` keeps each
    block's collectives in its own graph (a gather in forward, a re-gather
    and a reduce-scatter in backward, per block), also after the setting is
    changed back; bitwise equal to the reference."""
    for res in run_distributed(_off_rank, 2, timeout=600):
        assert_close(res, 0.0)
        assert res["graph_counts"] == [{"fw_all_gather": 2, "bw_all_gather": 2, "bw_reduce_scatter": 2}] * 3


def _factor_rank(rank: int, world: int) -> dict:
    """One step of blocks compiled on their own (aot_eager; the handoff on),
    with ``set_gradient_divide_factor(1.0)`` on every module (the sum over ranks) and
    with the default (the mean), each set before the first compiled step."""
    _, make_batch, loss = gpt_case(False)
    grads = {}
    for factor in (1.0, None):
        model = _routed()
        _shard()(model)
        if factor is not None:
            for m in model.modules():
                if isinstance(m, compiled_fsdp.FSDPModule):
                    m.set_gradient_divide_factor(factor)
        _per_block("aot_eager")(model)
        tokens = make_batch(rank)[0]
        loss(model(tokens), tokens).backward()
        grads[factor] = {n: whole(p.grad) for n, p in model.named_parameters()}
    return {n: (grads[1.0][n] / world - g).abs().max().item() for n, g in grads[None].items()}


def test_divide_factor_in_handed_over_reduces() -> None:
    """The gradients reduced by the handed-over gathers' backward
    (``reduce_next``) honour FSDP2's divide factor, as the others do: the sum
    is exactly ``world`` times the mean for every parameter. Before, the
    handoff markers did not carry the factor: every block (each one's gather
    is handed to it, layers.0's by the root) came out as the mean with the
    factor 1, up to 0.02 off."""
    for res in run_distributed(_factor_rank, 2):
        assert max(res.values()) == 0.0, {n: d for n, d in res.items() if d}


def _prefetch_rank(rank: int, world: int, bf16: bool, explicit: bool) -> dict:
    from compiled_fsdp.core.registry import CORE
    from compiled_fsdp.runtime.state import get_fsdp_state

    build, make_batch, loss = gpt_case(bf16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    CORE.backward_gathers.reset()
    seen = [0]

    def shard(model: torch.nn.Module) -> None:
        _shard(policy)(model)
        if explicit:  # FSDP2's explicit form: layers.1's backward prefetches nothing
            model.layers[1].set_modules_to_backward_prefetch([])

    def step_record(model: torch.nn.Module) -> tuple:
        taken, seen[0] = CORE.backward_gathers.taken - seen[0], CORE.backward_gathers.taken
        prefetched = [fqn for phase, fqn in get_fsdp_state(model).ctx.last_prefetched
                      if phase == "backward" and fqn.startswith("layers.")]
        return taken, prefetched

    return run_parity(rank, build, shard, make_batch, loss, wrap=_per_block("aot_eager"), after_step=step_record,
                      ref_forward=_eager_root_bf16 if bf16 else None)


@pytest.mark.parametrize("bf16,explicit", [(False, False), (True, False), (False, True)])
def test_backward_regathers_prefetched(bf16: bool, explicit: bool) -> None:
    """[Note: Backward re-gathers prefetched across graphs]: from the second
    step on both blocks' backward graphs take their re-gathers from gathers
    issued when a backward began: layers.1's, issued by the eager root's
    pre-backward (the module whose backward runs before it: [Note: Prefetch
    order]), and layers.0's, issued by layers.1's, as FSDP2's backward
    prefetch (none where ``set_modules_to_backward_prefetch([])`` says so:
    layers.0's own pre-backward issues it). Bitwise equal to the reference
    (bf16 gathers: to the bf16 reference): what is taken is the graph's own
    pack and gather."""
    for res in run_distributed(_prefetch_rank, 2, bf16, explicit, timeout=600):
        assert_close(res, 0.0)
        order = ["layers.1"] if explicit else ["layers.1", "layers.0"]
        assert res["after"] == [(0, []), (2, order), (2, order)], res["after"]

