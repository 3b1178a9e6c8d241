"""VGG19 as in HAP's benchmarks: plain conv + ReLU + max-pool stack, three-layer classifier.

Layout (parameter names in brackets), images (b, 3, H, W) float32 -> logits (b, classes):
  features.{k}: 16 conv 3x3 (padding 1, bias) + ReLU layers in five groups of 2, 2, 4, 4, 4 with
    c, 2c, 4c, 8c, 8c channels (c = 64 in VGG19), each group closed by a 2x2 max-pool;
    ``features.{k}.weight/.bias`` for the convolutions (k counts convs, ReLUs and pools, as
    torchvision's ``vgg19`` does)
  adaptive average pool to 7x7, flatten, classifier.0 Linear(8c*49 -> fc), ReLU,
  classifier.2 Linear(fc -> fc), ReLU, classifier.4 Linear(fc -> classes)
With c = 64 and fc = 4096 the classifier is HAP's 25088 -> 4096 -> 4096 -> 10. The 7x7 pool makes
both CIFAR-10's 32x32 images (1x1 maps, repeated) and ImageNet's 224x224 (7x7 maps, unchanged)
fit that classifier. No BatchNorm and no dropout, as in HAP's VGG19.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meshplan.zoo.checks import check_positive_ints

_CONVS_PER_GROUP = (2, 2, 4, 4, 4)
_GROUP_WIDTH = (1, 2, 4, 8, 8)  # channels of each group in units of the base channels
_POOLED = 7
_MIN_IMAGE = 2 ** len(_CONVS_PER_GROUP)  # five 2x2 pools need at least 32 pixels


@dataclass(frozen=True)
class VGGConfig:
    """Sizes of a VGG19: base ``channels`` (64), classifier width ``fc`` (4096), square ``image``
    side in pixels (>= 32), ``num_classes``. All ints >= 1.

    Raises TypeError for a non-int field, ValueError for a field < 1 or an image below 32.
    """

    channels: int = 64
    fc: int = 4096
    image: int = 32
    num_classes: int = 10

    def __post_init__(self) -> None:
        check_positive_ints(self)
        if self.image < _MIN_IMAGE:
            raise ValueError(f"VGGConfig.image={self.image} is too small: five 2x2 max-pools need >= {_MIN_IMAGE}")


def _features(channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    c_in = 3
    for num_convs, width in zip(_CONVS_PER_GROUP, _GROUP_WIDTH, strict=True):
        for _ in range(num_convs):
            layers += [nn.Conv2d(c_in, width * channels, 3, padding=1), nn.ReLU()]
            c_in = width * channels
        layers.append(nn.MaxPool2d(2, stride=2))
    return nn.Sequential(*layers)


class VGG19(nn.Module):
    """VGG19 classifier: images (b, 3, H, W) float32 -> logits (b, num_classes).

    Raises TypeError if ``config`` is not a VGGConfig.
    """

    def __init__(self, config: VGGConfig) -> None:
        super().__init__()
        if not isinstance(config, VGGConfig):
            raise TypeError(f"VGG19 expects a VGGConfig, got {type(config).__name__}")
        self.config = config
        self.features = _features(config.channels)
        self.avgpool = nn.AdaptiveAvgPool2d(_POOLED)
        flat = _GROUP_WIDTH[-1] * config.channels * _POOLED * _POOLED
        self.classifier = nn.Sequential(
            nn.Linear(flat, config.fc), nn.ReLU(),
            nn.Linear(config.fc, config.fc), nn.ReLU(),
            nn.Linear(config.fc, config.num_classes),
        )

    def forward(self, images: Tensor) -> Tensor:
        """Return logits (b, num_classes) for ``images`` (b, 3, H, W).

        Raises ValueError if ``images`` is not (b, 3, H, W).
        """
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"VGG19 expects images of shape (batch, 3, H, W), got {tuple(images.shape)}")
        return self.classifier(torch.flatten(self.avgpool(self.features(images)), 1))


def num_params(config: VGGConfig) -> int:
    """Scalar parameters of ``VGG19(config)``: conv weights 9*c_in*c_out + biases, then the
    classifier (8c*49 + 1)*fc + (fc + 1)*fc + (fc + 1)*classes."""
    total, c_in = 0, 3
    for num_convs, width in zip(_CONVS_PER_GROUP, _GROUP_WIDTH, strict=True):
        for _ in range(num_convs):
            c_out = width * config.channels
            total += 9 * c_in * c_out + c_out
            c_in = c_out
    flat = c_in * _POOLED * _POOLED
    return total + (flat + 1) * config.fc + (config.fc + 1) * config.fc + (config.fc + 1) * config.num_classes
