"""Vision Transformer as in HAP's benchmarks (CIFAR-10, 4x4 patches, ViT-Base sizes).

Layout (parameter names in brackets), images (b, 3, H, W) float32 -> logits (b, classes):
  patch_embed: Conv2d(3, hidden, patch, stride=patch) [patch_embed.weight, .bias], flattened to
    (b, N, hidden) tokens with N = (image / patch)^2, plus a learned position embedding [pos_embed]
    of shape (N, hidden)
  blocks.{i}: the GPT's pre-LayerNorm block with bidirectional (non-causal) attention and FFN 4h
  ln_f, mean over the N tokens, head Linear(hidden -> classes) [head.weight, head.bias]
Mean pooling replaces ViT's class token: a class token is a parameter concatenated in front of
the patch tokens, and pooling needs neither the extra parameter nor the concat. Initialisation as
the GPT (N(0, 0.02) for Linears, the patch projection and the position embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meshplan.zoo.checks import check_positive_ints

from meshplan.zoo import gpt

_INIT_STD = 0.02


@dataclass(frozen=True)
class ViTConfig:
    """Sizes of a ViT: ``hidden`` divisible by ``num_heads``, square ``image`` divisible by
    ``patch`` (both in pixels), ``num_classes``. All ints >= 1.

    Raises TypeError for a non-int field, ValueError for a field < 1 or an indivisible size.
    """

    hidden: int = 768
    num_layers: int = 12
    num_heads: int = 12
    patch: int = 4
    image: int = 32
    num_classes: int = 10

    def __post_init__(self) -> None:
        check_positive_ints(self)
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"ViTConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of hidden"
            )
        if self.image % self.patch != 0:
            raise ValueError(f"ViTConfig.image={self.image} is not divisible by patch={self.patch}")

    @property
    def num_patches(self) -> int:
        """Tokens per image: (image / patch)^2."""
        return (self.image // self.patch) ** 2


class ViT(nn.Module):
    """ViT classifier: images (b, 3, image, image) float32 -> logits (b, num_classes).

    Raises TypeError if ``config`` is not a ViTConfig.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"ViT expects a ViTConfig, got {type(config).__name__}")
        self.config = config
        h = config.hidden
        self.patch_embed = nn.Conv2d(3, h, config.patch, stride=config.patch)
        self.pos_embed = nn.Parameter(torch.empty(config.num_patches, h))
        self.blocks = nn.ModuleList(gpt.Block(h, config.num_heads, causal=False) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, config.num_classes)
        gpt.init_weights(self)
        for p in (self.patch_embed.weight, self.patch_embed.bias, self.pos_embed):
            nn.init.normal_(p, mean=0.0, std=_INIT_STD)

    def forward(self, images: Tensor) -> Tensor:
        """Return logits (b, num_classes) for ``images`` (b, 3, image, image).

        Raises ValueError if ``images`` does not have that shape.
        """
        side = self.config.image
        if tuple(images.shape[1:]) != (3, side, side):
            raise ValueError(f"ViT expects images of shape (batch, 3, {side}, {side}), got {tuple(images.shape)}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).mean(dim=1))


def num_params(config: ViTConfig) -> int:
    """Scalar parameters of ``ViT(config)``: patch projection (3*p^2 + 1)*h, positions N*h,
    blocks 12h^2 + 13h each, final LayerNorm 2h, head (h + 1)*classes."""
    h = config.hidden
    patch = (3 * config.patch**2 + 1) * h
    blocks = config.num_layers * (12 * h * h + 13 * h)
    return patch + config.num_patches * h + blocks + 2 * h + (h + 1) * config.num_classes
