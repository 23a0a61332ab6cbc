"""An in-place op on a view of a leaf parameter in forward, with grad enabled: eager PyTorch refuses it
("a view of a leaf Variable that requires grad is being used in an in-place operation")."""
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        w = self.lin.weight[0]   # (8,) view of a leaf parameter
        w.mul_(2)
        return self.lin(x).pow(2).mean()


def build_model():
    return Scaled()


def example_batch(batch, seq):
    return (torch.randn(batch, 8),)
