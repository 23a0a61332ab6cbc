"""Wild style: a small ResNet-like CNN: conv -> BatchNorm -> ReLU residual blocks, a strided stage, global
average pooling and a classifier (BatchNorm running stats are buffers updated in the forward)."""
import torch
import torch.nn.functional as F
from torch import nn

CLASSES, WIDTH, IMAGE = 10, 16, 32


class Residual(nn.Module):
    def __init__(self, channels_in, channels_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip = (nn.Identity() if stride == 1 and channels_in == channels_out
                     else nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                        nn.BatchNorm2d(channels_out)))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 3, 1, 1, bias=False), nn.BatchNorm2d(WIDTH), nn.ReLU())
        self.stages = nn.Sequential(Residual(WIDTH, WIDTH, 1), Residual(WIDTH, 2 * WIDTH, 2))
        self.fc = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, images, labels):
        x = self.stages(self.stem(images))                                           # (b, 2W, H/2, W/2)
        return F.cross_entropy(self.fc(x.mean((2, 3))), labels)


def build_model():
    return Net()


def example_batch(batch, seq):
    return torch.randn(batch, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch,))
