"""A complete model file for tracer: a tiny language model whose forward returns the loss.

Run:  python -m tracer examples/tiny_mlp_lm.py --seq 128 --batch 4
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 1000, 128


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)                               # (b, s, d)
        x = x + self.mlp(x)
        logits = self.head(x)                                # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model():
    return TinyLM()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))


def make_optimizer(params):                                  # optional: default is --optimizer adamw
    return torch.optim.AdamW(params, lr=3e-4, foreach=True)
