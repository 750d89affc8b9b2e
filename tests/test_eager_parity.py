"""The eager hook runtime against a single-process unsharded reference."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import compiled_fsdp
from compiled_fsdp import fully_shard
from examples.gpt import Block

from _dist import run_distributed
from _models import ChunkedHead, Twice, chunked_head_batch, gpt_case, twice_batch, twice_loss
from _parity import assert_close, full_params, in_regions, run_parity


def _shard_nested(model, **kwargs) -> None:  # noqa: ANN001
    """Each block, then the root, with the same ``fully_shard`` arguments."""
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _tol(world: int) -> float:
    # 2 ranks fed the same batch: (g + g) / 2 == g exactly, so bitwise. 3 ranks:
    # g + g + g rounds, so gradients match to 1 ulp; measured <= 7e-7 on params.
    return 0.0 if world == 2 else 1e-6


def _gpt_rank(rank: int, world: int, form: str, reshard: bool, tied: bool) -> dict:
    build, make_batch, loss = gpt_case(tied)

    def shard(model):
        if form == "nested":
            _shard_nested(model, reshard_after_forward=reshard)
        else:
            fully_shard(model, policy={Block}, reshard_after_forward=reshard)

    return run_parity(rank, build, shard, make_batch, loss)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("form,reshard,tied", [("nested", True, False), ("policy", False, True)])
def test_gpt_parity_and_counts(world: int, form: str, reshard: bool, tied: bool) -> None:
    results = run_distributed(_gpt_rank, world, form, reshard, tied)
    n_blocks, n_modules = 2, 3
    for res in results:
        assert_close(res, _tol(world))
        # One all-gather per module per forward, one more per block in backward when
        # resharding (the root never reshards after forward), one reduce-scatter each.
        gathers = n_modules + (n_blocks if reshard else 0)
        assert res["counts"] == [{"all_gather": gathers, "reduce_scatter": n_modules}] * 3


def _twice_rank(rank: int, world: int, reshard: bool) -> dict:
    def shard(model):
        for m in (model.pre, model.shared, model.frozen, model.spare):
            fully_shard(m, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)

    return run_parity(rank, Twice, shard, twice_batch, twice_loss)


@pytest.mark.parametrize("world,reshard", [(2, True), (3, False)])
def test_called_twice_frozen_unused(world: int, reshard: bool) -> None:
    """A module called twice, a frozen module, a module never called, a 0-dim parameter."""
    for res in run_distributed(_twice_rank, world, reshard):
        assert_close(res, _tol(world))
        # Forward: root, pre, shared, frozen, and shared again when it was resharded
        # between its two calls. spare never runs, so it is never gathered.
        fwd = 4 + (1 if reshard else 0)
        # Backward re-gathers (when resharding): pre, shared once (kept until both
        # uses are done), and frozen: no parameter gradient, but its input needs one.
        bwd = 3 if reshard else 0
        # Reduce-scatters: pre, shared, root (out). frozen has no trainable params.
        assert res["counts"] == [{"all_gather": fwd + bwd, "reduce_scatter": 3}] * 3


def _prefetch_rank(rank: int, world: int) -> list:
    from compiled_fsdp import get_fsdp_state

    build, make_batch, loss = gpt_case(False)
    seen = []
    shard = _shard_nested
    run_parity(rank, build, shard, make_batch, loss,
               after_step=lambda m: seen.append(get_fsdp_state(m).ctx.last_prefetched))
    return seen


def test_prefetch_forward_and_backward() -> None:
    """Backward prefetches the next block in reverse forward order from the first
    step; forward prefetch follows the previous step's order, so from step 2."""
    backward = [("backward", "layers.1"), ("backward", "layers.0")]
    forward = [("forward", "layers.0"), ("forward", "layers.1")]
    for seen in run_distributed(_prefetch_rank, 2):
        assert seen == [backward, forward + backward, forward + backward]


def _subgroup_rank(rank: int, world: int, backend: str) -> dict:
    """Two independent replicas, each sharded over its own 2-rank group."""
    import torch
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    build, make_batch, loss = gpt_case(False)

    def shard(model):
        _shard_nested(model, mesh=group)

    wrap = None if backend == "eager" else (lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return run_parity(rank % 2, build, shard, make_batch, loss, wrap=wrap)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_subgroup_mesh(backend: str) -> None:
    """fully_shard over a group smaller than the world: its reduce group is
    created by its members only (see [Note: A second group for
    reduce-scatters]); each replica matches the reference bitwise."""
    for res in run_distributed(_subgroup_rank, 4, backend):
        assert_close(res, 0.0)
        if backend == "eager":
            assert res["counts"] == [{"all_gather": 5, "reduce_scatter": 3}] * 3
        else:
            assert res["counts"] == [{}] * 3


def _one_group_rank(rank: int, world: int) -> dict:
    from compiled_fsdp import config, get_fsdp_state

    config.comm.separate_reduce_group = False
    build, make_batch, loss = gpt_case(False)
    groups = []

    def shard(model):
        _shard_nested(model)
        groups.extend(get_fsdp_state(m).param_group for m in (*model.layers, model))

    res = run_parity(rank, build, shard, make_batch, loss)
    res["one_group"] = all(g.reduce_group is g.process_group for g in groups)
    return res


def test_separate_reduce_group_off() -> None:
    """``config.comm.separate_reduce_group = False``: reduce-scatters stay on the
    gather group, with the same bitwise result."""
    for res in run_distributed(_one_group_rank, 2):
        assert res["one_group"]
        assert_close(res, 0.0)
        assert res["counts"] == [{"all_gather": 5, "reduce_scatter": 3}] * 3


class _Checkpointed(torch.nn.Module):
    """A block under activation checkpointing, with a random op whose value
    cannot matter (``0 * rand``): its recomputation saves rng states, which
    exposes the partitioner's ordering bug that compat.fix_rng_state_order
    works around (torch 2.12+; see compiled_fsdp/core/compat.py)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + 0.0 * torch.rand_like(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False)


def _checkpointed_rank(rank: int, world: int, backend: str) -> dict:
    build, make_batch, loss = gpt_case(False)
    compiled_fsdp.config.comm.block_regions = backend == "regions"
    backend = "aot_eager" if backend == "regions" else backend

    def build_checkpointed():
        model = build()
        model.layers = torch.nn.ModuleList(_Checkpointed(b) for b in model.layers)
        return model

    def shard(model):
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)

    wrap = None if backend == "none" else (lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return run_parity(rank, build_checkpointed, shard, make_batch, loss, wrap=wrap,
                      after_step=lambda m: sum(in_regions(m)))


@pytest.mark.parametrize("backend", ["none", "aot_eager", "regions"])
def test_activation_checkpointing(backend: str) -> None:
    """Each block under ``torch.utils.checkpoint``: the recomputation in
    backward reads the parameters the forward read (eager: exposed again at
    the block's pre-backward; compiled: the recomputed region's gathers;
    ``regions``: each checkpointed block a compile region, [Note: Blocks as
    compile regions]), bitwise equal to the reference."""
    for res in run_distributed(_checkpointed_rank, 2, backend):
        assert_close(res, 0.0)
        assert (res["after"][-1] > 0) == (backend == "regions"), res["after"]


def _two_forwards_rank(rank: int, world: int, case: str) -> dict:
    """Two root forwards, then one backward of both ([Note: Forwards before
    one backward] in runtime/state.py)."""
    if case == "partial":  # PyTorch's test_double_partial_forward_then_backward, trained
        def shard(model):
            fully_shard([model.norm, model.head])
            fully_shard(model)

        def twice(model):
            return lambda t1, t2: (model(t1, skip_head=True), model(t2, skip_head=True))

        return run_parity(rank, ChunkedHead, shard, chunked_head_batch, lambda hs, t1, t2: hs[0].sum() + hs[1].sum(),
                          wrap=twice, ref_forward=lambda ref, ts: twice(ref)(*ts))
    build, make_batch, loss = gpt_case(False)  # DPO's pattern: two full forwards, blocks resharded after forward

    def twice_gpt(model):
        return lambda t1, t2: (model(t1), model(t2))

    return run_parity(rank, build, lambda m: _shard_nested(m, reshard_after_forward=True),
                      lambda step: (make_batch(step)[0], make_batch(step + 50)[0]),
                      lambda outs, t1, t2: loss(outs[0], t1) - 0.5 * loss(outs[1], t2),
                      wrap=twice_gpt, ref_forward=lambda ref, ts: twice_gpt(ref)(*ts))


@pytest.mark.parametrize("case", ["partial", "dpo"])
def test_two_forwards_then_one_backward(case: str) -> None:
    """Before the fix, the second forward ended the first one's iteration:
    the partial list group's storage was freed under the first graph's saved
    tensors and its backward read freed memory (SIGSEGV on every rank)."""
    for res in run_distributed(_two_forwards_rank, 2, case):
        assert_close(res, 0.0)


def _retained_graph_rank(rank: int, world: int) -> float:
    """A partial forward of the ``[norm, head]`` group, then two backwards of
    the retained graph: the second finds the group resharded by the first's
    end and must gather it again before its backward reads it."""
    ref = ChunkedHead()
    model = ChunkedHead()
    fully_shard([model.norm, model.head])
    fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    worst = 0.0
    for step in range(3):
        tokens = chunked_head_batch(step)[0]
        for m, opt in zip((model, ref), opts):
            loss = m(tokens, skip_head=True).square().mean()
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
        full = full_params(model)
        worst = max(worst, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    return worst


def test_second_backward_of_a_retained_graph() -> None:
    assert run_distributed(_retained_graph_rank, 2) == [0.0, 0.0]
