"""The CS336 "basics" Transformer LM, written from the description of the two real CUDA snapshots it was
recorded in (the snapshots' README, beside the checkout in ../shared/snapshots when the tests read them).

A tracer model file (docs/guides/model-files.md) for the two shared CUDA snapshots: size "medium" (vocab 10,000,
d_model 1,024, 24 pre-norm blocks, 16 heads of 64, SwiGLU d_ff 4,096, untied embedding and output
projection, RoPE theta 10,000, no biases, no dropout; 423,183,360 parameters), batch 4, the course's own
AdamW in Python (state created lazily at the first step), cross-entropy written by hand.

    python -m tracer benchmarks/cs336_model.py --seq 128 --batch 4 --target cuda
    python -m tracer benchmarks/cs336_model.py --seq 512 --batch 4 --precision bf16 --target cuda

Ops follow the description, not the fused library versions, because memory depends on them:
  * Linear is `torch.einsum("...i,oi->...o", x, W)` (the description's einops einsum), with W (d_out, d_in).
    einsum lowers to bmm over reshaped views; under CUDA autocast the cast happens at the einsum.
  * attention is explicit: einsum(Q, K) / sqrt(d), torch.where(causal, scores, -inf), a hand-written
    softmax (x - max, exp, / sum), einsum(weights, V); every (seq x seq) score tensor of every head is saved.
  * RMSNorm upcasts to fp32 and casts back to the input dtype; RoPE tables are fp32 buffers (so q and k
    come out of RoPE in fp32 under autocast, as in the measured run).
  * forward returns the logits and `loss_fn` computes the loss, as the training script does.
Python locals are written as `name = ...` so the tracer sees how long each one holds its tensor.
The measured run's training script also keeps `logits` alive until after optimizer.step(); a model file
cannot express that, so those bytes (vocab x tokens) are a known difference.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class CS336Config:
    vocab_size: int = 10_000
    context_length: int = 512
    d_model: int = 1_024
    num_layers: int = 24
    num_heads: int = 16
    d_ff: int = 4_096
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def named(cls, size: str) -> "CS336Config":
        return SIZES[size]


SIZES = {
    "medium": CS336Config(),
    "debug": CS336Config(vocab_size=256, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=128),
}
SIZE = "medium"
BATCH = 4


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * std)          # the course truncates at 3 std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)                  # (..., d_out)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]                                          # (b, s, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)     # (b, s, 1)
        x = x * inv_rms
        x = x * self.weight                                                   # (b, s, d)
        return x.to(in_dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (x[2i], x[2i+1]) with fp32 cos/sin tables for positions 0..context-1."""

    def __init__(self, theta: float, head_dim: int, max_seq_len: int):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)   # (hd/2,)
        angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq         # (max_s, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]                             # (s, hd/2)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]                            # (b, h, s, hd/2)
        out_even = x_even * cos - x_odd * sin
        out_odd = x_even * sin + x_odd * cos
        return torch.stack((out_even, out_odd), dim=-1).flatten(-2)           # (b, h, s, hd)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x - x.max(dim=dim, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, causal: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])   # (b, h, s, s)
    scores = torch.where(causal, scores, float("-inf"))
    weights = softmax(scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", weights, v)                        # (b, h, s, hd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: CS336Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj = Linear(cfg.d_model, cfg.d_model)
        self.k_proj = Linear(cfg.d_model, cfg.d_model)
        self.v_proj = Linear(cfg.d_model, cfg.d_model)
        self.output_proj = Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = q.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)             # (b, h, s, hd)
        k = k.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        v = v.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        q = rope(q)
        k = rope(k)
        positions = torch.arange(s, device=x.device)                          # (s,)
        causal = positions[:, None] >= positions[None, :]                     # (s, s) bool
        out = scaled_dot_product_attention(q, k, v, causal)
        out = out.transpose(1, 2).reshape(b, s, d)                            # (b, s, d) copy
        return self.output_proj(out)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))                        # (b, s, d)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: CS336Config):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        attn_out = self.attn(self.ln1(x), rope)
        x = x + attn_out
        ffn_out = self.ffn(self.ln2(x))
        return x + ffn_out


class TransformerLM(nn.Module):
    def __init__(self, cfg: CS336Config):
        super().__init__()
        self.token_embeddings = Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.context_length)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x, self.rope)
        x = self.ln_final(x)
        return self.lm_head(x)                                                # (b, s, vocab)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    m = x.max(dim=dim, keepdim=True).values
    x = x - m
    return x - torch.log(torch.sum(torch.exp(x), dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    neg_log_probs = -log_softmax(logits, dim=-1)                              # (b, s, vocab)
    return torch.gather(neg_log_probs, -1, targets.unsqueeze(-1)).mean()


class AdamW(torch.optim.Optimizer):
    """The course's AdamW: decoupled weight decay, bias-corrected step size, state made at the first step.

    New moments are computed out of place and stored back into the state; the previous ones stay
    referenced by the loop's locals `m` and `v` until the next parameter rebinds them."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = p.grad.data
                p.data -= lr * weight_decay * p.data
                t = state.get("t", 1)
                m = state.get("m", torch.zeros_like(p.data))
                v = state.get("v", torch.zeros_like(p.data))
                state["m"] = beta1 * m + (1 - beta1) * grad
                state["v"] = beta2 * v + (1 - beta2) * grad ** 2
                lr_t = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                p.data -= lr_t * state["m"] / (torch.sqrt(state["v"]) + eps)
                state["t"] = t + 1


def build_model() -> TransformerLM:
    return TransformerLM(CS336Config.named(SIZE))


def example_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = CS336Config.named(SIZE).vocab_size
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits, targets)


def make_optimizer(params) -> AdamW:
    return AdamW(params)
