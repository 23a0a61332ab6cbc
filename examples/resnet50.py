"""A model file for tracer: ResNet-50 (He et al., 2015: bottleneck blocks of 1x1, 3x3, 1x1 convolutions with
batch norm, [3, 4, 6, 3] blocks per stage, 64..2048 channels), trained for classification with
cross-entropy. `seq` is the image side (224 in the paper).

Run:  python -m tracer examples/resnet50.py --batch 32 --seq 224
"""
import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 1000


def conv_bn(c_in, c_out, kernel, stride=1):
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(c_out))


class Bottleneck(nn.Module):
    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = 4 * width
        self.reduce = conv_bn(c_in, width, 1)
        self.spatial = conv_bn(width, width, 3, stride)
        self.expand = conv_bn(width, c_out, 1)
        self.shortcut = conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x):
        h = F.relu(self.reduce(x))
        h = F.relu(self.spatial(h))
        return F.relu(self.expand(h) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, classes=CLASSES):
        super().__init__()
        self.stem = conv_bn(3, 64, 7, 2)
        blocks, c_in = [], 64
        for stage, (count, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for i in range(count):
                blocks.append(Bottleneck(c_in, width, 2 if i == 0 and stage > 0 else 1))
                c_in = 4 * width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, classes)

    def forward(self, images, labels):
        x = F.max_pool2d(F.relu(self.stem(images)), 3, 2, padding=1)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


def build_model():
    return ResNet50()


def example_batch(batch, seq):
    return torch.randn(batch, 3, seq, seq), torch.randint(0, CLASSES, (batch,))
