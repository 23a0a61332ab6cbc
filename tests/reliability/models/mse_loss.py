"""A tiny regression model whose loss is F.mse_loss(model(x), y) (issue 16: the real CPU loss)."""
import torch
import torch.nn.functional as F
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 256)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y)   # x: (B, 64), y: (B, 256) -> 0-dim loss


def build_model():
    return Regressor()


def example_batch(batch, seq):
    return (torch.randn(batch, 64), torch.randn(batch, 256))
