"""Wild style: a Switch/Mixtral-like top-2 router written by hand: softmax over experts, top-k, renormalised
weights, a loop over experts with `torch.where`, gather and `index_add_`, plus an auxiliary load-balancing
loss. Its routing is forced balanced (token t prefers experts (t*k + j) % E by a large margin) so a real
step routes as tracer's `balanced` assumption does."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, EXPERTS, TOP_K = 128, 32, 4, 2


class SparseMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(DIM, 2 * DIM, bias=False) for _ in range(EXPERTS))
        self.w2 = nn.ModuleList(nn.Linear(2 * DIM, DIM, bias=False) for _ in range(EXPERTS))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                                 # (T, D)
        slots = torch.arange(x.shape[0])[:, None] * TOP_K + torch.arange(TOP_K)      # (T, k)
        bias = F.one_hot(slots % EXPERTS, EXPERTS).sum(1).to(x.dtype) * 1e4          # (T, E)
        probs = F.softmax(self.gate(x) + bias, dim=-1)                               # (T, E)
        weights, chosen = probs.topk(TOP_K, dim=-1)                                  # (T, k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(chosen == e)                                   # (n_e,)
            h = self.w2[e](F.silu(self.w1[e](x[token])))                             # (n_e, D)
            out.index_add_(0, token, h * weights[token, slot].unsqueeze(-1))
        aux = (probs.mean(0) * EXPERTS).pow(2).mean()                                # load-balancing loss
        return out.view(shape), aux


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.moe = SparseMoE()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        y, aux = self.moe(self.norm(x))
        x = x + y
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten()) + 0.01 * aux


def build_model():
    return Model()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))
