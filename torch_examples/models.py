"""A ResNet of configurable size (He et al. 2016), for the synthetic and CIFAR-10 examples.

torchvision does not import beside this machine's PyTorch, so the model is
written out: a stem, ``stages`` stages of ``blocks`` basic residual blocks each
(width doubling, resolution halving from the second stage), global pooling and
a linear classifier.  ``resnet(width=64, blocks=(2, 2, 2, 2))`` is ResNet-18's
layout; the defaults of the examples are far smaller, for 2-core machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BasicBlock(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet(torch.nn.Module):
    def __init__(self, width=16, blocks=(1, 1, 1), num_classes=10, in_channels=3):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                        torch.nn.BatchNorm2d(width), torch.nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet(width=16, blocks=(1, 1, 1), num_classes=10) -> ResNet:
    return ResNet(width, tuple(blocks), num_classes)
