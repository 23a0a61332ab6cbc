"""Wild style: a ViT as research code writes it: einops patchify, a class token and learned positions,
trunc_normal_ initialisation, pre-norm blocks with fused qkv attention via SDPA, GELU MLP, cross-entropy."""
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

IMAGE, PATCH, DIM, HEADS, DEPTH, CLASSES = 32, 8, 64, 4, 3, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        qkv = rearrange(self.qkv(self.norm1(x)), "b n (k h d) -> k b h n d", k=3, h=HEADS)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(rearrange(y, "b h n d -> b n (h d)"))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(3 * PATCH * PATCH, DIM)
        self.cls = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos = nn.Parameter(torch.zeros(1, (IMAGE // PATCH) ** 2 + 1, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.cls, std=0.02)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def forward(self, images, labels):
        x = self.patch(rearrange(images, "b c (h p) (w q) -> b (h w) (p q c)", p=PATCH, q=PATCH))
        x = torch.cat([repeat(self.cls, "1 1 d -> b 1 d", b=x.shape[0]), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


def build_model():
    return ViT()


def example_batch(batch, seq):
    return torch.randn(batch, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch,))
