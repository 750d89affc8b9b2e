"""Small models for tests, each with a batch maker and a loss."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiled_fsdp import fully_shard
from examples.gpt import GPT, Block, GPTConfig, tiny, tiny_tied
from examples.gpt import batch as gpt_batch
from examples.gpt import loss_fn as gpt_loss


def shard_each(model: nn.Module) -> None:
    """``fully_shard`` on each block of ``model.layers``, then on the root: the usual form."""
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


class ScaledLinear(nn.Linear):
    """A Linear with a learnable one-element output scale."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Twice(nn.Module):
    """``shared`` is called twice per forward; ``frozen`` never trains; ``spare``
    owns a parameter that forward never uses; ``pre.scale`` has one element (fewer rows than ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = ScaledLinear(7, 13)
        self.shared = nn.Sequential(nn.Linear(13, 13), nn.Tanh())
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.spare = nn.Linear(13, 5)
        self.out = nn.Linear(13, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 13))

    def forward(self, x: torch.Tensor, y: object = None) -> torch.Tensor:
        h = self.pre(x) + self.offset
        h = self.shared(h)
        h = self.frozen(h)
        h = self.shared(h)
        return self.out(h)


class ChunkedHead(nn.Module):
    """An embedding, a body, then ``[norm, head]`` (the group torchtitan's
    chunked loss runs on its own); ``skip_head`` stops before the head, so a
    list group ``[norm, head]`` runs only partly."""

    def __init__(self, dim: int = 32, vocab: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def chunked_head_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


def twice_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 7, generator=g), torch.randint(0, 3, (5,), generator=g)


def twice_loss(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y)


def gpt_case(tied: bool = False):
    build = tiny_tied if tied else tiny
    cfg = build().cfg
    return build, (lambda step: (gpt_batch(cfg, 2, step),)), (lambda logits, toks: gpt_loss(logits, toks))


class BreakGPT(GPT):
    """The tiny GPT with a graph break where ``where`` says:

    - "block": inside layers.1's forward (``torch._dynamo.graph_break()``)
    - "data_dep": a data-dependent ``if`` on a tensor value inside layers.1
    - "between": in the root's forward, between layers.0 and layers.1
    - "twice": inside layers.0, which the root calls twice
    - "loop": inside layers.1, called in the tiny GPT's loop over its blocks
    """

    def __init__(self, where: str, tie_head: bool = False) -> None:
        torch.manual_seed(0)
        super().__init__(GPTConfig(vocab=67, dim=24, n_layers=2, n_heads=2, seq=16, tie_head=tie_head))
        self.where = where
        if where in ("block", "data_dep", "twice", "loop"):
            idx = 0 if where == "twice" else 1
            self.layers[idx].__class__ = DataDepBlock if where == "data_dep" else BreakBlock

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        if self.where == "loop":
            for block in self.layers:
                x = block(x)
            return self.head(self.norm(x))
        x = self.layers[0](x)
        if self.where == "twice":
            x = self.layers[0](x)
        if self.where == "between":
            torch._dynamo.graph_break()
        x = self.layers[1](x)
        return self.head(self.norm(x))


class BreakBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.norm2(x))


class DataDepBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if x.abs().max() > 0:  # data-dependent: Dynamo cannot trace the branch
            x = x * 1.0
        return x + self.mlp(self.norm2(x))


def break_case(where: str, tied: bool = False):
    cfg = tiny().cfg
    return ((lambda: BreakGPT(where, tied)), (lambda step: (gpt_batch(cfg, 2, step),)),
            (lambda logits, toks: gpt_loss(logits, toks)))
