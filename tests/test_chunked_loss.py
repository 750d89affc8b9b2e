"""torchtitan's training pattern, its chunked loss and torch 2.15's FSDP2 API,
against a single-process unsharded reference after several AdamW steps.

The decoder is torchtitan's shape: an embedding, blocks, ``[norm, lm_head]``
sharded as one list group (``reshard_after_forward=False``) and a root that
owns no parameter (examples/torchtitan_pattern.py). ``chunked_loss`` follows
torchtitan 0.3.0's ``ChunkedLossWrapper``: the model's forward stops after the norm, the head
runs once per chunk on a detached leaf with a backward in between (its
gradient sync off but for the last chunk, resharding off), and one backward
then runs through the body ([Note: Several backwards of one forward] in
runtime/context.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_fsdp
from compiled_fsdp import fully_shard, get_fsdp_state
from compiled_fsdp.core import compat
from examples.torchtitan_pattern import chunked_loss, selective_ac, shard_like_torchtitan

from _dist import run_distributed
from _graphs import GraphCapture, saved_gathered
from _parity import whole

VOCAB, DIM = 128, 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(layers)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (torchtitan's _skip_lm_head=True)
        h = self.tok(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.norm(h)


def shard(model: Decoder, **kwargs) -> None:  # noqa: ANN003
    shard_like_torchtitan(fully_shard, model, model.tok, list(model.layers.values()), model.norm, model.lm_head,
                          **kwargs)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)


def _clean(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("._checkpoint_wrapped_module", "")


def _reference_grads(ref: Decoder, step: int, world: int, rank: int, body: bool = True) -> torch.Tensor:
    """The reference's gradients for ``step``: each rank's chunked loss apart
    (``body``: then its body's backward), the gradients summed in rank order,
    as the reduction with divide factor 1.0 sums them; returns ``rank``'s loss."""
    mine, summed = None, None
    for r in range(world):
        t, y = batch(step, r)
        part = chunked_loss(ref.lm_head, ref(t), y)
        if body:
            part.backward()
        mine = part if r == rank else mine
        grads = [p.grad for p in ref.parameters()]
        summed = grads if summed is None else [a if b is None else b if a is None else a + b
                                               for a, b in zip(summed, grads)]
        ref.zero_grad(set_to_none=True)
    for p, g in zip(ref.parameters(), summed):
        p.grad = g
    return mine


def _titan_rank(rank: int, world: int, mode: str) -> dict:
    """``mode``: eager; ``blocks``: torchtitan's per-block compile (selective AC,
    then ``block.compile(fullgraph=True)``, then fully_shard), with and without
    torchtitan's ``skip_fwd_side_effects_in_bwd_under_checkpoint``; ``whole``:
    the root compiled. The reference trains on every rank's batch (the sum of
    the ranks' gradients, as the divide factor 1.0 makes it)."""
    capture = GraphCapture()
    backend = capture.backend if mode.startswith("blocks") else "aot_eager"
    compiled_fsdp.config.comm.block_regions = mode == "regions"
    ref, model = Decoder(), Decoder()
    if mode != "eager":
        for key, block in list(model.layers.items()):
            model.layers[key] = selective_ac(block)
    flag = mode == "blocks+flag"
    flag = compat.set_side_effects_under_checkpoint(flag) and flag  # (a release without it: as off)
    if mode.startswith("blocks"):
        for block in model.layers.values():
            block.compile(backend=backend, fullgraph=True)
    shard(model)
    run = torch.compile(model, backend=backend) if mode in ("whole", "regions") else model
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    out: dict = {"loss": [], "param": [], "gathers": [], "flag": flag, "prefetched": []}
    for step in range(3):
        compiled_fsdp.reset_collective_counts()
        tokens, labels = batch(step, rank)
        loss = chunked_loss(model.lm_head, run(tokens), labels)
        loss.backward()
        out["gathers"].append(compiled_fsdp.collective_counts().get("all_gather", 0))
        out["prefetched"].append([_clean(fqn) for phase, fqn in get_fsdp_state(model).ctx.last_prefetched
                                  if phase == "backward"])
        ref_loss = _reference_grads(ref, step, world, rank)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["loss"].append((loss - ref_loss).abs().item())
        full = {_clean(n): whole(p) for n, p in model.named_parameters()}
        out["param"].append(max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    out["explain"] = [(r.fqn, r.path) for r in compiled_fsdp.explain(model)]
    out["saved_gathered"] = [saved_gathered(g) for g in capture.forward]
    return out


@pytest.mark.parametrize("mode", ["eager", "blocks", "blocks+flag", "whole", "regions"])
def test_torchtitan_chunked_loss(mode: str) -> None:
    """Bitwise to the reference (eager and aot_eager; the divide factor 1.0
    sums two ranks' gradients, as the reference's two backwards do). Eagerly,
    each step gathers the embedding, 3 blocks and ``[norm, head]`` in forward
    (the head's chunks reuse the gather), then in backward the blocks and
    ``[norm, head]`` once more for the norm (torchtitan reshards the head
    after its chunks): 9. FSDP2 also gathers the embedding for its backward,
    which never reads it ([Note: Embeddings are not gathered for backward] in
    runtime/backward_use.py): 10. Under per-block compile the blocks' backward
    gathers are in their graphs, and so are the forward gathers each block
    hands the next: 3 eager gathers remain, and the first block's handed
    gather (the embedding runs eagerly): 4. Without torchtitan's flag the
    checkpointed blocks hand over eager gathers ([Note: Handoffs and
    activation checkpointing] in compile/path.py): 6. No block's forward
    graph saves a gathered weight, or the gathered bucket, for its backward:
    the norm's output, which the selective policy recomputes, is recomputed
    in backward from the re-gathered norm weight (passes/handoff.py,
    ``_read_again_in_backward``; saving the bucket cost 3.2 GiB at 8 blocks of
    Llama-3.1-8B on an H100). The backward prefetches in backward order, one
    module ahead ([Note: Prefetch order] in runtime/context.py): the eager
    head's pre-backward issues the last block's graph re-gather, each block's
    graph its predecessor's (before, the head prefetched the embedding first
    and the first block prefetched nothing). Compiled whole with the blocks
    compile regions (the embedding one too, of another class): bitwise
    (before [Note: Blocks as compile regions] (4), the second block ran on
    the first block's weights)."""
    for res in run_distributed(_titan_rank, 2, mode):
        assert max(res["loss"]) == 0.0 and max(res["param"]) == 0.0, res
        if mode == "eager":
            assert res["gathers"] == [9, 9, 9], res["gathers"]
        elif mode.startswith("blocks"):
            assert res["gathers"] == [4 if res["flag"] else 6] * 3, res["gathers"]
            assert len(res["saved_gathered"]) == 1 and res["saved_gathered"] == [[]], res["saved_gathered"]
            assert res["prefetched"][-1] == ["layers.2", "layers.1", "layers.0"], res["prefetched"]
        assert ("", "compiled" if mode in ("whole", "regions") else "eager") in res["explain"], res["explain"]


class _LM(nn.Module):
    """An embedding, a block and a head (tied to the embedding or not)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.block = nn.Embedding(VOCAB, DIM), _Block()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.tok(tokens)))


def _embedding_rank(rank: int, world: int, case: str) -> dict:
    """``case``: ``plain`` (the embedding sharded on its own); ``user``: the
    same after ``set_unshard_in_backward(True)``; ``checkpointed``: the
    embedding wrapped by ``checkpoint_wrapper`` (its backward recomputes the
    lookup); ``tied``: the head's weight is the embedding's (one group of
    both). 3 AdamW steps against the single-process reference; all-gathers
    per step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref, model = _LM(case == "tied"), _LM(case == "tied")
    if case == "checkpointed":
        model.tok = checkpoint_wrapper(model.tok)
    fully_shard([model.tok, model.lm_head] if case == "tied" else model.tok)
    fully_shard(model.block)
    fully_shard(model)
    if case == "user":
        model.tok.set_unshard_in_backward(True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    out: dict = {"gathers": [], "param": 0.0}
    for step in range(3):
        compiled_fsdp.reset_collective_counts()
        tokens, labels = batch(step, rank)
        F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
        out["gathers"].append(compiled_fsdp.collective_counts().get("all_gather", 0))
        for r in range(world):  # (the mean of the ranks' losses: the reduction's average)
            t, y = batch(step, r)
            (F.cross_entropy(ref(t).flatten(0, 1), y.flatten()) / world).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = {_clean(n): whole(p) for n, p in model.named_parameters()}
        out["param"] = max(out["param"], max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    return out


@pytest.mark.parametrize("case", ["plain", "user", "checkpointed", "tied"])
def test_embedding_not_gathered_for_backward(case: str) -> None:
    """The eager embedding's backward gathers nothing: 4 all-gathers a step
    (forward: the embedding, the block, the root's head; backward: the
    block), where FSDP2 gathers 5. The user's ``set_unshard_in_backward(True)``
    and a checkpointed lookup (recomputed in backward) gather it again: 5. A
    head tied to the embedding makes one group of both, gathered in forward
    and again for the head's backward: 4. Within 1e-6 of the reference after
    3 AdamW steps (the reference sums the ranks' means in one ``.grad``, so
    rounding differs). [Note: Embeddings are not gathered for backward]."""
    expected = {"plain": 4, "user": 5, "checkpointed": 5, "tied": 4}[case]
    for res in run_distributed(_embedding_rank, 2, case):
        assert res["gathers"] == [expected] * 3, res["gathers"]
        assert res["param"] < 1e-6, res["param"]


def _kept_rank(rank: int, world: int, mode: str) -> dict:
    """torchtitan's layout (``mode``: eager, or blocks compiled on their own
    under selective AC). Step 1 runs the chunks' backwards only, never the
    body's, so the gathers issued for the body's backward when the forward
    ended are never taken; the optimizer steps and every parameter is halved;
    step 2 must read the new parameters. The reference does the same. Also how many re-gathers the
    blocks' graphs took from a gather issued ahead, per step."""
    from compiled_fsdp.core.registry import CORE

    ref, model = Decoder(), Decoder()
    if mode == "blocks":
        compat.set_side_effects_under_checkpoint(True)
        for key, block in list(model.layers.items()):
            model.layers[key] = selective_ac(block)
            model.layers[key].compile(backend="aot_eager", fullgraph=True)
    shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    out: dict = {"param": [], "taken": []}
    for step in range(4):
        taken = CORE.backward_gathers.taken
        tokens, labels = batch(step, rank)
        loss = chunked_loss(model.lm_head, model(tokens), labels)
        if step != 1:
            loss.backward()
        out["taken"].append(CORE.backward_gathers.taken - taken)
        _reference_grads(ref, step, world, rank, body=step != 1)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step == 1:  # (the blocks got no gradient, so AdamW left them: change them)
            with torch.no_grad():
                for p in [*model.parameters(), *ref.parameters()]:
                    p.mul_(0.5)
        full = {_clean(n): whole(p) for n, p in model.named_parameters()}
        out["param"].append(max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    return out


@pytest.mark.parametrize("mode", ["eager", "blocks"])
def test_gathers_issued_at_the_forward_end(mode: str) -> None:
    """[Note: Prefetch order]: the gathers of the first two blocks of the
    backward, issued when the forward ends, outlive the chunks' backwards
    (each ends the iteration) and serve the body's backward: eagerly 9
    all-gathers a step (test_torchtitan_chunked_loss; 11 when they were
    dropped), and the 3 blocks' graphs take 3 gathers issued ahead from the
    third step on (the first compiles them; the second runs no body
    backward). A step whose body backward never runs leaves them untaken:
    they are dropped when the next step begins, whose forward and backward
    read the parameters the optimizer wrote (bitwise the reference's)."""
    for res in run_distributed(_kept_rank, 2, mode):
        assert max(res["param"]) == 0.0, res["param"]
        if mode == "blocks":
            assert res["taken"] == [0, 0, 3, 3], res["taken"]
