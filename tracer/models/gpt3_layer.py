"""One GPT-3-style transformer layer as analysed by Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models": pre-LayerNorm, fused QKV projection, explicit softmax(QK^T)
attention with dropout on the probabilities, output projection + dropout, 4h GELU MLP + dropout.

Input is a hidden-state tensor `x` of shape (s, b, h) (sequence first, as in the paper); the loss is
`y.sum()`, whose backward saves nothing. The causal mask is an additive (s, s) bias buffer, so no mask
is saved for backward. In 16-bit with bool dropout masks the layer saves s*b*h*(34 + 5*a*s/h) bytes
plus the LayerNorm statistics (mean and rstd per token, for each of the two LayerNorms).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT3LayerConfig:
    d_model: int = 12_288
    n_heads: int = 96
    dropout: float = 0.1
    max_seq_len: int = 2_048

    @classmethod
    def named(cls, size: str) -> "GPT3LayerConfig":
        return GPT3_LAYER_SIZES[size]


GPT3_LAYER_SIZES = {
    "175b": GPT3LayerConfig(),
    "debug": GPT3LayerConfig(d_model=64, n_heads=4, max_seq_len=256),
}


class GPT3Layer(nn.Module):
    def __init__(self, cfg: GPT3LayerConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.d_model
        self.ln_1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        mask = torch.full((cfg.max_seq_len, cfg.max_seq_len), float("-inf")).triu(1)
        self.register_buffer("causal_bias", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a, p = self.cfg.n_heads, self.cfg.dropout
        q, k, v = self.qkv(x).chunk(3, dim=-1)                               # (s, b, h) each
        q = q.reshape(s, b * a, h // a).transpose(0, 1)                      # (b*a, s, hd)
        k = k.reshape(s, b * a, h // a).transpose(0, 1)
        v = v.reshape(s, b * a, h // a).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(h // a)         # (b*a, s, s)
        scores = scores + self.causal_bias[:s, :s].to(scores.dtype)
        probs = F.dropout(torch.softmax(scores, dim=-1), p, self.training)  # (b*a, s, s)
        ctx = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, h)           # (s, b, h)
        return F.dropout(self.proj(ctx), p, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        y = x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln_2(x)))), self.cfg.dropout, self.training)
        return y.sum()


def example_batch(cfg: GPT3LayerConfig, batch: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randn(seq, batch, cfg.d_model),)
