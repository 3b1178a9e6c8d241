"""Wide-ResNet (Alpa's suite): a bottleneck ResNet whose 3x3 convolutions are ``width`` times wider.

Layout (parameter names in brackets), images (b, 3, H, W) float32 -> logits (b, classes):
  stem: conv 7x7 stride 2 (3 -> c) [stem_conv.weight], BN [stem_bn.*], ReLU, max-pool 3x3 stride 2
  stages.{i}.{j} for stage i in 0..3 with f = c * 2**i filters, stride 2 in the first block of
  stages 1..3:
    conv1 1x1 (in -> f), BN, ReLU; conv2 3x3 stride s (f -> f*width), BN, ReLU;
    conv3 1x1 (f*width -> 4f), BN; shortcut = proj_conv 1x1 stride s + proj_bn in a stage's first
    block (where the shape changes), identity elsewhere; out = ReLU(shortcut + residual branch)
  adaptive average pool to 1x1, flatten, fc Linear(4 * 8c -> classes) [fc.weight, fc.bias]
Convolutions have no bias (the following BN has one). Blocks per stage: 26 layers (2,2,2,2),
50 (3,4,6,3), 101 (3,4,23,3). BatchNorm2d uses batch statistics and keeps no running statistics
(``track_running_stats=False``): a planned training step has no use for them, and their update is
an in-place buffer mutation in the traced graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.zoo.checks import check_positive_ints

BLOCKS_PER_STAGE = MappingProxyType({26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)})


@dataclass(frozen=True)
class WResNetConfig:
    """Sizes of a Wide-ResNet: ``num_layers`` in 26/50/101, base ``channels``, ``width`` factor of
    the 3x3 convolutions, square ``image`` side in pixels, ``num_classes``. All ints >= 1.

    Raises TypeError for a non-int field, ValueError for a field < 1 or an unknown depth.
    """

    num_layers: int
    channels: int
    width: int
    image: int
    num_classes: int

    def __post_init__(self) -> None:
        check_positive_ints(self)
        if self.num_layers not in BLOCKS_PER_STAGE:
            raise ValueError(
                f"WResNetConfig.num_layers={self.num_layers} is not a known depth; "
                f"valid depths: {sorted(BLOCKS_PER_STAGE)}"
            )

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Number of bottleneck blocks in each of the four stages."""
        return BLOCKS_PER_STAGE[self.num_layers]


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, track_running_stats=False)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (widened, strided) -> 1x1 residual branch with a projection shortcut if needed."""

    def __init__(self, c_in: int, filters: int, width: int, stride: int) -> None:
        super().__init__()
        inner, c_out = filters * width, 4 * filters
        self.conv1, self.bn1 = _conv(c_in, filters, 1), _bn(filters)
        self.conv2, self.bn2 = _conv(filters, inner, 3, stride), _bn(inner)
        self.conv3, self.bn3 = _conv(inner, c_out, 1), _bn(c_out)
        self.proj_conv: nn.Conv2d | None = None
        self.proj_bn: nn.BatchNorm2d | None = None
        if stride != 1 or c_in != c_out:
            self.proj_conv, self.proj_bn = _conv(c_in, c_out, 1, stride), _bn(c_out)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (b, c_in, h, w) -> (b, 4 * filters, h / stride, w / stride)."""
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        shortcut = x if self.proj_conv is None else self.proj_bn(self.proj_conv(x))
        return F.relu(shortcut + y)


class WideResNet(nn.Module):
    """Wide-ResNet classifier: images (b, 3, H, W) float32 -> logits (b, num_classes).

    Raises TypeError if ``config`` is not a WResNetConfig.
    """

    def __init__(self, config: WResNetConfig) -> None:
        super().__init__()
        if not isinstance(config, WResNetConfig):
            raise TypeError(f"WideResNet expects a WResNetConfig, got {type(config).__name__}")
        self.config = config
        c = config.channels
        self.stem_conv, self.stem_bn = _conv(3, c, 7, 2), _bn(c)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, c_in = [], c
        for i, num_blocks in enumerate(config.stage_blocks):
            filters = c * 2**i
            blocks = []
            for j in range(num_blocks):
                blocks.append(Bottleneck(c_in, filters, config.width, 2 if i > 0 and j == 0 else 1))
                c_in = 4 * filters
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, config.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Return logits (b, num_classes) for ``images`` (b, 3, H, W).

        Raises ValueError if ``images`` is not (b, 3, H, W).
        """
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"WideResNet expects images of shape (batch, 3, H, W), got {tuple(images.shape)}")
        x = self.pool(F.relu(self.stem_bn(self.stem_conv(images))))
        x = self.stages(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def num_params(config: WResNetConfig) -> int:
    """Scalar parameters of ``WideResNet(config)`` (BN: weight and bias per channel).

    Block with input c_in and f filters: c_in*f + 9*w*f^2 + 4*w*f^2 convolution weights, BN
    2*(f + w*f + 4f), plus c_in*4f + 8f for the projection in each stage's first block.
    """
    c, w = config.channels, config.width
    total, c_in = 3 * 49 * c + 2 * c, c
    for i, num_blocks in enumerate(config.stage_blocks):
        f = c * 2**i
        for j in range(num_blocks):
            total += c_in * f + 9 * w * f * f + 4 * w * f * f + 2 * (f + w * f + 4 * f)
            if j == 0:
                total += c_in * 4 * f + 8 * f
            c_in = 4 * f
    return total + c_in * config.num_classes + config.num_classes
