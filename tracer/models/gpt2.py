"""GPT-2 (124M, 355M, 774M, 1558M and a debug size): learned positions, pre-LayerNorm blocks with biases,
GELU MLP, fused causal SDPA, configurable dropout, tied output head. Forward returns the mean cross-entropy.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    vocab_size: int = 50_257
    max_seq_len: int = 1_024
    n_layers: int = 12
    n_heads: int = 12
    d_model: int = 768
    dropout: float = 0.0

    @classmethod
    def named(cls, size: str) -> "GPT2Config":
        return GPT2_SIZES[size]


GPT2_SIZES = {
    "124m": GPT2Config(),
    "355m": GPT2Config(n_layers=24, n_heads=16, d_model=1_024),
    "774m": GPT2Config(n_layers=36, n_heads=20, d_model=1_280),
    "1558m": GPT2Config(n_layers=48, n_heads=25, d_model=1_600),
    "debug": GPT2Config(vocab_size=512, max_seq_len=256, n_layers=2, n_heads=4, d_model=64),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.cfg.n_heads
        q, k, v = self.c_attn(x).split(d, dim=2)                              # (b, s, d) each
        q = q.view(b, s, h, d // h).transpose(1, 2)                           # (b, h, s, hd)
        k = k.view(b, s, h, d // h).transpose(1, 2)
        v = v.view(b, s, h, d // h).transpose(1, 2)
        p = self.cfg.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, d)                                # (b, s, d)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, s = tokens.shape
        pos = torch.arange(s, device=tokens.device)                          # (s,)
        x = self.drop(self.wte(tokens) + self.wpe(pos))                      # (b, s, d)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                                  # (b, s, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def example_batch(cfg: GPT2Config, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    return tokens, torch.randint(0, cfg.vocab_size, (batch, seq))
