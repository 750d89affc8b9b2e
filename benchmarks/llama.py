"""A Llama-3-style decoder for the GPU check: RMSNorm, rotary attention with
grouped-query heads (``scaled_dot_product_attention``, causal), SwiGLU FFN,
untied output head; optionally each block under activation checkpointing.

``LLAMA_3_1_8B`` has Llama-3.1-8B's dimensions; ``LLAMA_1B`` is a ~1.1B model
that keeps one GPU busy at world size 1; ``LLAMA_TINY`` is for CPU tests.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    seq: int
    rope_theta: float = 500000.0
    checkpoint_blocks: bool = False  # activation checkpointing per block

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_(self, **kw) -> "LlamaConfig":
        return replace(self, **kw)


LLAMA_3_1_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256, seq=8192)
LLAMA_1B = LlamaConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn=8192, vocab=32000, seq=2048)
LLAMA_TINY = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=48, vocab=97, seq=16)


def rope_tables(cfg: LlamaConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [batch, heads, seq, head_dim]; rotates pairs (even, odd) in fp32."""
    t = x.shape[2]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:t], sin[:t]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        # (-1 heads: under tensor parallelism a rank holds some of them)
        q = self.wq(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.checkpointed = cfg.checkpoint_blocks
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.feed_forward = FeedForward(cfg)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # torchtitan's full activation checkpointing, per block
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg, self.output.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.output.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter and buffer, in place (also after meta init + ``to_empty``)."""
        cos, sin = rope_tables(self.cfg, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for m in self.modules():
            for p in m.parameters(recurse=False):
                p = p.to_local() if hasattr(p, "to_local") else p  # a shard: each rank draws its own
                if isinstance(m, nn.RMSNorm):
                    nn.init.ones_(p)
                else:
                    nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        """Logits; with ``skip_head`` the normed hidden states (torchtitan's
        ``_skip_lm_head``, for its chunked loss)."""
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        h = self.norm(x)
        return h if skip_head else self.output(h)

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token as torchtitan counts them (6 x the
        non-embedding parameters + 12 x layers x heads x head_dim x seq; the
        recomputation of activation checkpointing not counted)."""
        c = self.cfg
        n = sum(p.numel() for p in self.parameters()) - self.tok_embeddings.weight.numel()
        return 6 * n + 12 * c.n_layers * c.n_heads * c.head_dim * c.seq


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def batch(cfg: LlamaConfig, batch_size: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch_size, cfg.seq), generator=g).to(device)
