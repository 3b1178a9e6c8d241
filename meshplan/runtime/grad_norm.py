"""Gradient clipping by the global norm, as ``torch.nn.utils.clip_grad_norm_`` clips on one
device: the norm over every element of every gradient, each counted once however many ranks
hold it, and every gradient scaled by ``max_norm / (norm + 1e-6)`` where that is below 1.

The engines (`Trainer`, `PipelineTrainer`) hand their part of the norm (`Trainer.norm_part`:
the sum of ``|g| ** p`` over the mesh, the largest ``|g|`` for p = inf) and scale their own
gradients; this module holds what is the same for both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def check_clip_args(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats. Raises ValueError unless ``max_norm`` is a finite
    number >= 0 and ``norm_type`` a number > 0 or inf."""
    ok = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and \
        math.isfinite(max_norm) and max_norm >= 0
    if not ok:
        raise ValueError(f"max_norm must be a finite number >= 0, got {max_norm!r}")
    ok = isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool) and \
        not math.isnan(norm_type) and norm_type > 0
    if not ok:
        raise ValueError(f"norm_type must be a number > 0 or inf (2.0: the Euclidean norm), "
                         f"got {norm_type!r}")
    return float(max_norm), float(norm_type)


def norm_from(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm from the engines' reduced ``total`` (`Trainer.norm_part`)."""
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, kept on the device (no host round trip)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def check_finite(norm: torch.Tensor, norm_type: float) -> None:
    """RuntimeError when ``norm`` is nan or inf (clip_grad_norm_'s ``error_if_nonfinite``)."""
    if not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"the total norm of order {norm_type:g} of the parallel model's gradients is "
            f"{float(norm)}: it cannot be clipped. Pass error_if_nonfinite=False to clip "
            "anyway (the gradients become nan)")


def clip_engines(total: torch.Tensor, norm_type: float, max_norm: float,
                 error_if_nonfinite: bool, trainers: Iterable[Any]) -> torch.Tensor:
    """``clip_grad_norm_`` once the engines' parts are reduced to ``total``: every trainer's
    gradients scaled by the factor of the norm; returns the norm."""
    norm = norm_from(total, norm_type)
    if error_if_nonfinite:
        check_finite(norm, norm_type)
    factor = clip_factor(norm, max_norm)
    for t in trainers:
        t.scale_gradients(factor)
    return norm
