"""A model file for tracer: VGG-16 (Simonyan and Zisserman, 2014, configuration D: thirteen 3x3 convolutions
in five stages of 64..512 channels, each stage ending in 2x2 max pooling, then three fully connected
layers), trained for classification with cross-entropy. `seq` is the image side (224 in the paper; the
classifier reads a 7x7 grid, adaptively pooled for other sizes).

Run:  python -m tracer examples/vgg16.py --batch 32 --seq 224
"""
import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 1000
STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))     # (channels, convolutions)


class Stage(nn.Module):
    def __init__(self, c_in, c_out, convs):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c_in if i == 0 else c_out, c_out, 3, padding=1) for i in range(convs))

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return F.max_pool2d(x, 2)


class VGG16(nn.Module):
    def __init__(self, classes=CLASSES):
        super().__init__()
        c_in, stages = 3, []
        for channels, convs in STAGES:
            stages.append(Stage(c_in, channels, convs))
            c_in = channels
        self.stages = nn.ModuleList(stages)
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                        nn.Linear(4096, classes))

    def forward(self, images, labels):
        x = images
        for stage in self.stages:
            x = stage(x)
        x = F.adaptive_avg_pool2d(x, 7).flatten(1)
        return F.cross_entropy(self.classifier(x), labels)


def build_model():
    return VGG16()


def example_batch(batch, seq):
    return torch.randn(batch, 3, seq, seq), torch.randint(0, CLASSES, (batch,))
