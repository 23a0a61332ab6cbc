"""Wild style: a small diffusion UNet: sinusoidal time embedding, residual conv blocks with GroupNorm and
SiLU and a time projection, strided downsampling, nearest upsampling with skip concatenation, a
self-attention block at the bottleneck, noise-prediction MSE loss."""
import math

import torch
import torch.nn.functional as F
from torch import nn

CH, IMAGE, TDIM = 32, 16, 64


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(TDIM, cout)
        self.norm2 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm = nn.GroupNorm(8, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        attn = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        y = (v @ attn.transpose(1, 2)).reshape(b, c, h, w)
        return x + self.out(y)


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = nn.Sequential(nn.Linear(TDIM, TDIM), nn.SiLU(), nn.Linear(TDIM, TDIM))
        self.inp = nn.Conv2d(3, CH, 3, padding=1)
        self.down1 = ResBlock(CH, CH)
        self.pool1 = nn.Conv2d(CH, CH, 3, stride=2, padding=1)
        self.down2 = ResBlock(CH, 2 * CH)
        self.mid = AttnBlock(2 * CH)
        self.up2 = ResBlock(4 * CH, CH)
        self.up1 = ResBlock(2 * CH, CH)
        self.out = nn.Sequential(nn.GroupNorm(8, CH), nn.SiLU(), nn.Conv2d(CH, 3, 3, padding=1))

    def forward(self, x, t, noise):
        temb = self.time(timestep_embedding(t, TDIM))
        h0 = self.inp(x)
        h1 = self.down1(h0, temb)
        h2 = self.down2(self.pool1(h1), temb)
        h = self.mid(h2)
        h = self.up2(torch.cat([h, h2], dim=1), temb)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = self.up1(torch.cat([h, h1], dim=1), temb)
        return F.mse_loss(self.out(h), noise)


def build_model():
    return UNet()


def example_batch(batch, seq):
    return torch.randn(batch, 3, IMAGE, IMAGE), torch.randint(0, 1000, (batch,)), torch.randn(batch, 3, IMAGE, IMAGE)
