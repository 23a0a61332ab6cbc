"""An in-place op on a leaf parameter itself in forward, with grad enabled: eager PyTorch refuses it
("a leaf Variable that requires grad is being used in an in-place operation")."""
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        self.lin.weight.add_(1)   # the leaf parameter itself, in place
        return self.lin(x).pow(2).mean()


def build_model():
    return Scaled()


def example_batch(batch, seq):
    return (torch.randn(batch, 8),)
