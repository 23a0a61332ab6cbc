"""Wild style: Swin-like window attention: torch.roll shifts, window partition/merge by view+permute, a
relative position bias table gathered with an index buffer, nn.MultiheadAttention-free qkv, label
smoothing in the loss."""
import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, WIN, SIDE, CLASSES = 32, 2, 4, 8, 10


def window_partition(x, w):
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, w * w, c)


def window_reverse(windows, w, h, wd):
    b = int(windows.shape[0] / (h * wd / w / w))
    x = windows.view(b, h // w, wd // w, w, w, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, wd, -1)


class WindowAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.table = nn.Parameter(torch.zeros((2 * WIN - 1) ** 2, HEADS))
        coords = torch.stack(torch.meshgrid(torch.arange(WIN), torch.arange(WIN), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (WIN - 1)
        self.register_buffer("index", rel[..., 0] * (2 * WIN - 1) + rel[..., 1], persistent=False)

    def forward(self, x):
        bw, n, c = x.shape
        qkv = self.qkv(x).reshape(bw, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * (c // HEADS) ** -0.5) @ k.transpose(-2, -1)
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
        attn = (attn + bias.unsqueeze(0)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))


class SwinBlock(nn.Module):
    def __init__(self, shift):
        super().__init__()
        self.shift = shift
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = WindowAttention()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, h, w, c = x.shape
        shortcut = x
        x = self.norm1(x)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = window_reverse(self.attn(window_partition(x, WIN)), WIN, h, w)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, stride=2)
        self.blocks = nn.Sequential(SwinBlock(0), SwinBlock(WIN // 2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, images, labels):
        x = self.embed(images).permute(0, 2, 3, 1)
        x = self.norm(self.blocks(x)).mean(dim=(1, 2))
        return F.cross_entropy(self.head(x), labels, label_smoothing=0.1)


def build_model():
    return Swin()


def example_batch(batch, seq):
    return torch.randn(batch, 3, 2 * SIDE, 2 * SIDE), torch.randint(0, CLASSES, (batch,))
