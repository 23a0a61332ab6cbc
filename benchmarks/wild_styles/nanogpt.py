"""Wild style: nanoGPT (Karpathy) as people copy it: fused qkv, SDPA is_causal, GELU MLP, tied embedding and
head, forward(idx, targets) -> (logits, loss)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BLOCK = 256, 64, 4, 2, 64


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(DIM, dim=2)                                  # 3 x (B, T, C)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)                          # (B, nh, T, hs)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                             # (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(BLOCK, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight                                       # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)               # (t,)
        x = self.wte(idx) + self.wpe(pos)                                            # (b, t, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                                          # (b, t, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build_model():
    return GPT()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))
