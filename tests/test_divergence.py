"""Ranks that diverge get a clear error on every rank in bounded time; ranks that
merely differ in shapes get none. See [Note: Agreeing on collectives] in
compiled_fsdp/runtime/divergence.py. Every case runs under the launcher's timeout, so a
regression that hangs fails the test instead of CI."""
from __future__ import annotations

import copy
import time
from typing import Optional

import pytest
import torch

import compiled_fsdp
from compiled_fsdp.tools.check_worker import max_diff, shard_specs
from examples.gpt import GPT, GPTConfig, batch, loss_fn

from _dist import run_distributed
from _models import shard_each

BOUND_S = 8.0
FULL = (0, 1)


class RoutedGPT(GPT):
    """The tiny GPT whose blocks run in the order ``route`` says (a rank-dependent
    forward when ranks set different routes)."""

    route: tuple[int, ...] = FULL
    graph_break = False  # break the root's graph after its first block

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for n, i in enumerate(self.route):
            x = self.layers[i](x)
            if n == 0 and self.graph_break:
                torch._dynamo.graph_break()
        return self.head(self.norm(x))


def _build() -> RoutedGPT:
    torch.manual_seed(0)
    return RoutedGPT(GPTConfig(vocab=67, dim=24, n_layers=2, n_heads=2, seq=16))


def _wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "eager":
        return model
    if mode == "blocks":  # each block compiled on its own, the root eager
        for block in model.layers:
            block.compile(backend="aot_eager")
        return model
    return torch.compile(model, backend=mode)


def _diverge(rank: int, world: int, mode: str, routes: list[list[tuple[int, ...]]],
             sleep_before: Optional[int] = None, reset: bool = False) -> dict:
    """Train 3 steps with ``routes[rank][step]``; ``sleep_before``: rank 1 sleeps
    past the bound before that step; ``reset``: ``torch._dynamo.reset()`` after
    sharding. Returns what was raised, where and when, and whether Dynamo
    could be reset afterwards."""
    compiled_fsdp.config.comm.check_timeout_s = BOUND_S
    compiled_fsdp.config.comm.block_regions = mode == "regions"
    model = _build()
    model.graph_break = mode == "aot_eager_break"
    mode = {"regions": "aot_eager"}.get(mode, mode).removesuffix("_break")
    shard_each(model)
    if reset:
        torch._dynamo.reset()
    runner = _wrap(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    start = time.monotonic()
    try:
        for step in range(3):
            if sleep_before == step and rank == 1:
                time.sleep(BOUND_S + 4)
            start = time.monotonic()
            model.route = routes[rank][step]
            tokens = batch(model.cfg, 2, step)
            loss_fn(runner(tokens), tokens).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        elapsed = time.monotonic() - start
        notes = "\n".join(getattr(e, "__notes__", ()))  # see annotate_error
        torch._dynamo.reset()  # must still work after an error in Dynamo's compile callback
        return {"type": type(e).__name__, "message": f"{e}\n{notes}", "step": step, "elapsed": elapsed}
    return {"type": None, "step": step}


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "aot_eager_break", "blocks", "regions"])
def test_rank_skips_a_block(mode: str) -> None:
    """Rank 1 skips layers.1 from the first step: both ranks raise, naming it
    (no Inductor case: the check is the joint pass's, before any backend, and
    Inductor lowers the same check ops in every Inductor test);
    also with a graph break in the root's forward (two frames, each checked),
    and with each block compiled on its own (rank 1's layers.0 hands layers.1
    a gather as rank 0's does; both blocks run the one graph both ranks
    agreed on, so the ranks differ at the backward's check, which compares
    the modules each forward ran); and with the blocks compile regions,
    whose reads are traced once for both blocks: the outer graph's calls of
    the regions are in its checked sequence (before, rank 0 ran its second
    region's gather alone and gloo aborted the process)."""
    routes = [[FULL] * 3, [(0,)] * 3]
    for rank, res in enumerate(run_distributed(_diverge, 2, mode, routes, timeout=300)):
        assert res["step"] == 0 and "CollectiveMismatchError" in res["type"] + res["message"], res
        msg = res["message"]
        assert "collectives differ" in msg and "rank 0" in msg and "rank 1" in msg, msg
        assert "layers.1" in msg and "rank-dependent path" in msg, msg
        if mode == "eager":  # found by comparing, not by waiting (compiled: the time includes compiling)
            assert res["elapsed"] < 1, res


def test_checks_survive_dynamo_reset() -> None:
    """``torch._dynamo.reset()`` after ``fully_shard`` clears Dynamo's callbacks;
    the root's forward registers them again, so the new graphs are still checked."""
    for res in run_distributed(_diverge, 2, "aot_eager", [[FULL] * 3, [(0,)] * 3], None, True, timeout=300):
        assert res["step"] == 0 and "collectives differ" in res["message"], res
        assert "a new compiled graph reading <root>, layers.0, <root>" in res["message"], res


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "regions"])
def test_rank_calls_a_block_again(mode: str) -> None:
    """Rank 0 calls layers.0 a second time: eager in step 1 (after a clean
    step 0, with the forward prefetches of step 0's order in flight), compiled
    from step 0 (for a later step see test_rank_compiles_another_path_later)."""
    first = 1 if mode == "eager" else 0
    routes = [[FULL] * first + [(0, 1, 0)] * (3 - first), [FULL] * 3]
    for res in run_distributed(_diverge, 2, mode, routes, timeout=300):
        assert res["step"] == first and "CollectiveMismatchError" in res["type"] + res["message"], res
        assert "collectives differ" in res["message"] and "layers.0" in res["message"], res


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_sleeping_rank(mode: str) -> None:
    """Rank 1 sleeps past the bound before step 1's forward: rank 0 raises within
    the bound, naming the check it waits at and rank 1; rank 1 raises when it
    wakes, quoting rank 0."""
    r0, r1 = run_distributed(_diverge, 2, mode, [[FULL] * 3] * 2, 1, timeout=300)
    assert r0["type"] == "CollectiveMismatchError" and r0["step"] == 1, r0
    assert "rank(s) 1 did not arrive" in r0["message"], r0
    assert "the start of the forward in step 2" in r0["message"], r0
    assert BOUND_S - 1 < r0["elapsed"] < BOUND_S + 3, r0
    assert r1["type"] == "CollectiveMismatchError" and "rank 0 already failed" in r1["message"], r1
    assert "rank(s) 1 did not arrive" in r1["message"] and r1["elapsed"] < 2, r1


def test_rank_compiles_another_path_later() -> None:
    """Rank 1 skips layers.1 from step 1 on, after a clean step 0: it compiles a
    new graph and waits at its check, while rank 0 runs the graph both agreed
    on and waits in its first all-gather. Rank 1 raises at the bound; rank 0's
    collective fails as rank 1 exits, carrying rank 1's report as a note."""
    r0, r1 = run_distributed(_diverge, 2, "aot_eager", [[FULL] * 3, [FULL, (0,), (0,)]], timeout=300)
    assert "CollectiveMismatchError" in r1["type"] + r1["message"] and r1["step"] == 1, r1
    assert "rank(s) 0 did not arrive" in r1["message"] and "reading <root>, layers.0, <root>" in r1["message"], r1
    assert r0["step"] == 1 and "Rank 1 failed first and reported" in r0["message"], r0
    assert "rank(s) 0 did not arrive" in r0["message"], r0


def _uneven(rank: int, world: int, mode: str, how: str) -> dict:
    """Ranks with different batch sizes (``how="batch"``) or a sequence length that
    changes on rank 1 only at step 2, so it alone recompiles (``how="recompile"``).
    Against a reference that averages the ranks' losses, as the reduce-scatter does."""
    compiled_fsdp.config.comm.check_timeout_s = BOUND_S
    ref = _build()
    model = copy.deepcopy(ref)
    shard_each(model)
    specs = shard_specs(model)
    runner = _wrap(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def tokens(r: int, step: int) -> torch.Tensor:
        t = batch(ref.cfg, 2 + r if how == "batch" else 2, 10 * step + r)
        return t[:, :12] if how == "recompile" and r == 1 and step == 2 else t

    diffs = []
    for step in range(3):
        mine = tokens(rank, step)
        with torch.no_grad():  # an evaluation forward: checked, no backward
            runner(mine)
        loss_fn(runner(mine), mine).backward()
        ref_loss = sum(loss_fn(ref(tokens(r, step)), tokens(r, step)) for r in range(world)) / world
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        named = dict(model.named_parameters())
        diffs.append(max(max_diff(named[n].detach(), specs[id(named[n])].local(p.detach(), rank))
                         for n, p in ref.named_parameters()))
    return {"param_diff": diffs}


@pytest.mark.parametrize("mode,how", [("eager", "batch"), ("aot_eager", "batch"), ("aot_eager", "recompile"),
                                      ("blocks", "recompile")])
def test_no_false_alarm(mode: str, how: str) -> None:
    """Different per-rank batch sizes, and one rank recompiling for a new shape
    (its graph reads the same parameters in the same order: harmless), train
    as the reference does and raise nothing; so do the no_grad forwards
    before each step (under aot_eager their markers run unlowered, each
    parameter's collective checked); so do blocks compiled on their own,
    whose graphs hand each other gathers, in training and in the no_grad
    forwards. (Under Inductor the checks are the same: test_rank_skips_a_block[inductor].)"""
    for res in run_distributed(_uneven, 2, mode, how, timeout=400):
        assert max(res["param_diff"]) < 1e-5, res
