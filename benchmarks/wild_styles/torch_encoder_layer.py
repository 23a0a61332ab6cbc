"""Wild style: torch's own nn.TransformerEncoderLayer (norm_first, batch_first, GELU, dropout 0) stacked in a
ModuleList (nn.TransformerEncoder deep-copies its layer), with nn.MultiheadAttention inside."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 128, 64, 4, 2


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, activation="gelu",
                                                               batch_first=True, norm_first=True)
                                    for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build_model():
    return Encoder()


def example_batch(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))
