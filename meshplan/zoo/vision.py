"""What the image classifiers of the zoo (Wide-ResNet, VGG19, ViT) share: batch and loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def classification_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` (batch, classes) against int64 labels ``target`` (batch,)."""
    return F.cross_entropy(logits, target)


def make_image_batch(
    batch: int, image: int, num_classes: int, *, device: str, generator: torch.Generator
) -> tuple[tuple[Tensor], Tensor]:
    """Return ``((images,), labels)``: float32 (batch, 3, image, image) standard normal and int64
    (batch,) uniform in [0, num_classes).

    On device "meta" the tensors have shapes only; elsewhere they are drawn from ``generator``.
    Raises TypeError for a non-int size, ValueError for a size < 1.
    """
    for name, value in (("batch", batch), ("image", image), ("num_classes", num_classes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    images = torch.randn(batch, 3, image, image, generator=generator, device=device)
    labels = torch.randint(0, num_classes, (batch,), generator=generator, device=device)
    return (images,), labels
