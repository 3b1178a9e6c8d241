"""Sufficient-factor broadcasting at run time (`meshplan.planner.intra.sfb`).

Lowering runs an SFB weight's consumer on the detached weight, so autograd computes only the
activation's gradient through it, and wraps the output in `weight_grad`: identity forward;
in backward it all-gathers the activation and the output gradient over the batch and returns
the weight operand's gradient as one einsum over the whole batch — the same on every member,
so the trainer synchronizes nothing for that weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

from meshplan.runtime.comm import Comm

# One all-gather of a factor: (dim, mesh axes, per-member sizes, impl), applied in order.
Gather = tuple[int, tuple[int, ...], tuple[int, ...], str]


def weight_grad(comm: Comm, y: torch.Tensor, weight: torch.Tensor, activation: torch.Tensor,
                activation_gathers: tuple[Gather, ...], output_gathers: tuple[Gather, ...],
                equation: str) -> torch.Tensor:
    """``y`` unchanged; in backward, ``weight``'s gradient ``einsum(equation, activation,
    dy)`` over the factors gathered whole by ``activation_gathers`` / ``output_gathers``."""
    return _WeightGrad.apply(y, weight, activation, comm, tuple(activation_gathers),
                             tuple(output_gathers), equation)


def _gather(comm: Comm, t: torch.Tensor, gathers: tuple[Gather, ...]) -> torch.Tensor:
    for dim, axes, sizes, impl in gathers:
        t = comm.all_gather(t.contiguous(), axes, dim, sizes, phase="backward", impl=impl)
    return t


class _WeightGrad(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, y: torch.Tensor, weight: torch.Tensor,
                activation: torch.Tensor, comm: Comm, activation_gathers: tuple[Gather, ...],
                output_gathers: tuple[Gather, ...], equation: str) -> torch.Tensor:
        ctx.save_for_backward(activation)
        ctx.comm, ctx.gathers, ctx.equation = comm, (activation_gathers, output_gathers), equation
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (activation,) = ctx.saved_tensors
        with torch.no_grad():
            whole_a = _gather(ctx.comm, activation.detach(), ctx.gathers[0])
            whole_dy = _gather(ctx.comm, grad, ctx.gathers[1])
            dw = torch.einsum(ctx.equation, whole_a, whole_dy)
        return grad, dw, None, None, None, None, None
