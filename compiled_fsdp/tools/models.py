"""A small GPT-style decoder: token embedding, pre-norm blocks (causal attention +
MLP), final norm, and a head that can be tied to the embedding."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    seq: int = 256
    tie_head: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # No bias: the key bias has a zero gradient in exact math (softmax is shift
        # invariant), so its float gradient is rounding noise that AdamW amplifies.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_head:
            self.head.weight = self.embed.weight
        nn.init.normal_(self.pos, std=0.02)

    def init_weights(self) -> None:
        """Initialize every parameter in place, as ``__init__`` does (for a model
        built on ``meta``, sharded, then ``to_empty``)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(cfg: GPTConfig, batch_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch_size, cfg.seq), generator=g)


def tiny(tie_head: bool = False) -> GPT:
    """A model small enough for tests: 2 blocks, odd sizes so shards are uneven."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=67, dim=24, n_layers=2, n_heads=2, seq=16, tie_head=tie_head))


def tiny_tied() -> GPT:
    return tiny(tie_head=True)


def bench(n_layers: int = 8, dim: int = 512) -> GPT:
    """The benchmark model: ~30M parameters (d=512, 8 blocks, vocab 4096)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layers=n_layers, dim=dim))
