import torch
from torch import nn


class NoParams(nn.Module):
    def forward(self, x):
        return (x * 2).pow(2).mean()


def build_model():
    return NoParams()


def example_batch(batch, seq):
    return (torch.randn(batch, 8),)
