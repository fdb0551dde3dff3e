"""The small models both executors' tests run (`test_executor`, `test_native`): an MLP with
dropout, ResNet-18 with batch norm, the zoo's GPT-2 with dropout; each builder seeds torch and
returns (model, example inputs as a tuple)."""
from __future__ import annotations

import torch
import torch.nn as nn

from remat.frontends import zoo


class DropoutMLP(nn.Module):
    """Blocks of Linear-ReLU-Dropout in a Sequential of Sequentials (the outer loop holds each
    block's input while the block runs, what native execution observes) and a head."""

    def __init__(self, width: int = 64, layers: int = 6):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1))
                                      for _ in range(layers)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.layers(x))


def mlp():
    torch.manual_seed(0)
    return DropoutMLP(), (torch.randn(32, 64),)


def resnet():
    torch.manual_seed(0)
    m, x = zoo.get("resnet18", batch=8, image_size=64)  # (activations a third of the step: plans have room)
    return m, (x if isinstance(x, tuple) else (x,))


def gpt():
    torch.manual_seed(0)
    m, x = zoo.get("gpt2")
    return m, (x if isinstance(x, tuple) else (x,))


MODELS = {"mlp-dropout": mlp, "resnet18-batchnorm": resnet, "gpt2-dropout": gpt}
