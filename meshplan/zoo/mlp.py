"""A stack of square Linear layers with ReLU between them: the smallest model worth planning.

Parameter names are ``layers.{i}.weight`` (hidden, hidden) and ``layers.{i}.bias`` (hidden,),
so planner golden tests can name them directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `layers=True` is a typo, not a size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"MLP {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"MLP {name} must be >= 1, got {value}")


class MLP(nn.Module):
    """``num_layers`` Linear(hidden, hidden) layers with ReLU between them (none after the last).

    Input and output have shape (batch, hidden), float32.
    Raises TypeError if a size is not an int or ``bias`` is not a bool, ValueError if a size < 1.
    """

    def __init__(self, hidden: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        _check_positive_int("hidden", hidden)
        _check_positive_int("num_layers", num_layers)
        if not isinstance(bias, bool):
            raise TypeError(f"MLP bias must be a bool, got {bias!r} ({type(bias).__name__})")
        self.hidden = hidden
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layers to ``x`` of shape (batch, hidden); returns (batch, hidden)."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i != last:
                x = F.relu(x)
        return x


def mlp_loss(out: Tensor, target: Tensor) -> Tensor:
    """Mean squared error between ``out`` and ``target`` (both (batch, hidden)); a 0-d tensor."""
    return F.mse_loss(out, target)


def num_params(hidden: int, num_layers: int, bias: bool) -> int:
    """Number of scalar parameters of ``MLP(hidden, num_layers, bias)``."""
    return num_layers * (hidden * hidden + (hidden if bias else 0))


def make_example_batch(
    batch: int, hidden: int, *, device: str, generator: torch.Generator
) -> tuple[tuple[Tensor], Tensor]:
    """Return ``((x,), target)``, both float32 of shape (batch, hidden), standard normal.

    On device "meta" the tensors have shapes only; elsewhere they are drawn from ``generator``.
    Raises TypeError/ValueError if ``batch`` or ``hidden`` is not a positive int.
    """
    _check_positive_int("batch", batch)
    _check_positive_int("hidden", hidden)
    x = torch.randn(batch, hidden, generator=generator, device=device)
    target = torch.randn(batch, hidden, generator=generator, device=device)
    return (x,), target
