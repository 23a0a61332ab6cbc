"""Wild style: attention written with einops (rearrange) and einsum, an explicit causal mask and softmax,
pre-norm RMSNorm, a SwiGLU MLP."""
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 256, 64, 4, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        q, k, v = rearrange(self.to_qkv(x), "b n (three h d) -> three b h n d", three=3, h=HEADS)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5         # (b, h, n, n)
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)                            # (n, n)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)                               # (b, h, n, d)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = nn.Linear(DIM, 2 * 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.ModuleList([nn.RMSNorm(DIM), Attention(), nn.RMSNorm(DIM), FeedForward()])
                                    for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)                                                       # (b, n, DIM)
        for norm1, attn, norm2, ff in self.layers:
            x = x + attn(norm1(x))
            x = x + ff(norm2(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(rearrange(logits, "b n v -> (b n) v"), rearrange(targets, "b n -> (b n)"))


def build_model():
    return Model()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))
