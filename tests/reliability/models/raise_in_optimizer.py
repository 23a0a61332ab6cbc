import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def build_model():
    return Tiny()


def example_batch(batch, seq):
    return (torch.randn(batch, 8),)



def make_optimizer(params):
    raise RuntimeError("no optimizer today")
