"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention through fused SDPA, SwiGLU, tied head.

`LlamaConfig.named("88m")` has exactly 88,096,512 parameters. K and V are passed to
`F.scaled_dot_product_attention(..., enable_gqa=True)` un-repeated, so no repeated copies are saved.
The forward returns the mean cross-entropy loss of next-token prediction over `targets`.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 32_768
    d_model: int = 768
    n_layers: int = 10
    n_heads: int = 12
    n_kv_heads: int = 4
    d_ff: int = 2_048
    max_seq_len: int = 4_096
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def named(cls, size: str) -> "LlamaConfig":
        return LLAMA_SIZES[size]


LLAMA_SIZES = {
    "88m": LlamaConfig(),
    "debug": LlamaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                         max_seq_len=1_024),
    "7b": LlamaConfig(vocab_size=32_000, d_model=4_096, n_layers=32, n_heads=32, n_kv_heads=32,
                      d_ff=11_008, tie_embeddings=False),
    "70b": LlamaConfig(vocab_size=128_256, d_model=8_192, n_layers=80, n_heads=64, n_kv_heads=8,
                       d_ff=28_672, rope_theta=500_000.0, tie_embeddings=False, max_seq_len=8_192),
    # Llama 3.1 405B's shape: 405,853,388,800 parameters, as published
    "405b": LlamaConfig(vocab_size=128_256, d_model=16_384, n_layers=126, n_heads=128, n_kv_heads=8,
                        d_ff=53_248, rope_theta=500_000.0, tie_embeddings=False, max_seq_len=8_192),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(cfg: LlamaConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)          # (s, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]                                     # (b, h, s, hd/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (b, h, s, hd/2, 2)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, s, c.n_heads, c.head_dim).transpose(1, 2)      # (b, h, s, hd)
        k = self.wk(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)   # (b, kv, s, hd)
        v = self.wv(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)   # (b, kv, s, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, s, c.d_model)                       # (b, s, d)
        return self.wo(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, s = tokens.shape
        cos, sin = rope_tables(self.cfg, s)                                  # (s, hd/2) each
        x = self.embed(tokens)                                               # (b, s, d)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))                                  # (b, s, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def example_batch(cfg: LlamaConfig, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    targets = torch.randint(0, cfg.vocab_size, (batch, seq))
    return tokens, targets

