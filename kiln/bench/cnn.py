"""A small ResNet-style image classifier in plain torch, and its FLOP count.

The zoo needs one model that is not a Hugging Face transformer: convolutions,
BatchNorm (which carries running-statistics buffers that a compiler must update)
and a classification head.  The layout is described once by ``stage_plan`` so
the model and the analytic FLOP count cannot drift apart.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from kiln.bench import flops


class ClassifierOutput(NamedTuple):
    """What ``model(**batch)`` returns; a NamedTuple so tracers see a plain pytree."""

    loss: torch.Tensor
    logits: torch.Tensor


def stage_plan(blocks: int, width: int) -> list[tuple[int, int]]:
    """(channels, stride) of each residual block.

    Up to four stages; channel count doubles (and resolution halves) per stage,
    ending at ``width`` channels.  Extra blocks beyond four are spread over the
    stages in order, as in ResNet-18/34.
    """
    stages = max(1, min(blocks, 4))
    per_stage = [blocks // stages + (1 if i < blocks % stages else 0) for i in range(stages)]
    plan = []
    for i, count in enumerate(per_stage):
        channels = max(1, width >> (stages - 1 - i))
        for j in range(count):
            plan.append((channels, 2 if (j == 0 and i > 0) else 1))
    return plan


def stem_channels(blocks: int, width: int) -> int:
    return stage_plan(blocks, width)[0][0]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a (projected when needed) shortcut, then ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """Stem (stride-2 conv3x3) -> residual blocks -> global average pool -> Linear."""

    def __init__(self, blocks: int, width: int, num_classes: int):
        super().__init__()
        plan = stage_plan(blocks, width)
        c0 = plan[0][0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, c0, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c0), nn.ReLU())
        layers, in_ch = [], c0
        for channels, stride in plan:
            layers.append(BasicBlock(in_ch, channels, stride))
            in_ch = channels
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> ClassifierOutput:
        x = self.blocks(self.stem(pixel_values))
        logits = self.head(x.mean(dim=(2, 3)))
        return ClassifierOutput(F.cross_entropy(logits, labels), logits)


def _conv_out(size: int, stride: int) -> int:
    # 3x3 with padding 1 and 1x1 with padding 0 both give ceil(size / stride).
    return (size + stride - 1) // stride


def forward_flops(batch: int, image: int, blocks: int, width: int, num_classes: int) -> int:
    """Analytic forward FLOPs of ``ResNet(blocks, width, num_classes)`` on square images."""
    plan = stage_plan(blocks, width)
    size = _conv_out(image, 2)
    total = flops.conv2d(batch, 3, plan[0][0], 3, size, size)  # stem
    in_ch = plan[0][0]
    for channels, stride in plan:
        size = _conv_out(size, stride)
        total += flops.conv2d(batch, in_ch, channels, 3, size, size)
        total += flops.conv2d(batch, channels, channels, 3, size, size)
        if stride != 1 or in_ch != channels:
            total += flops.conv2d(batch, in_ch, channels, 1, size, size)
        in_ch = channels
    return total + flops.linear(batch, in_ch, num_classes)
