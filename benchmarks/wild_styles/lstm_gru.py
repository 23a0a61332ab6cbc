"""Wild style: a recurrent language model: embedding -> 2-layer nn.LSTM -> nn.GRU -> linear head (CPU kernels,
batch_first)."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 128, 32


class RNNLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.lstm = nn.LSTM(DIM, DIM, num_layers=2, batch_first=True)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        x, _ = self.lstm(self.embed(tokens))                                         # (b, s, DIM)
        x, _ = self.gru(x)                                                           # (b, s, DIM)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build_model():
    return RNNLM()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))
