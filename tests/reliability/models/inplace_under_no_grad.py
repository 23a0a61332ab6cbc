"""In-place updates of parameters under torch.no_grad() in forward (weight renormalisation, as EMA or
max-norm constraints do): allowed in eager, so predicted."""
import torch
from torch import nn


class Renormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight[0].mul_(0.5)                              # a view of the leaf, in place
            self.lin.weight.div_(self.lin.weight.norm().clamp(min=1))  # the leaf itself, in place
        return self.lin(x).pow(2).mean()


def build_model():
    return Renormed()


def example_batch(batch, seq):
    return (torch.randn(batch, 8),)
