"""What the model sees of autograd while it is traced is what it sees in eager training.

Code that reads ``requires_grad`` (a custom op that precomputes its gradient only when asked, as
torch's chunked linear cross-entropy does) must see the parameters require one; factory ops given
tensors (``torch.linspace(t, ...)``) take their values, not a gradient path, as in eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import Workload
from oracle import assert_matches, reference, train_rank

SGD = OptimizerSpec("sgd", lr=0.05)


@torch.library.custom_op("meshplan_test::square_with_grad", mutates_args=())
def _square_with_grad(x: torch.Tensor, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x**2`` and, when asked, its gradient ``2x`` computed in forward."""
    return x * x, (2 * x if want_grad else torch.zeros_like(x))


@_square_with_grad.register_fake
def _(x: torch.Tensor, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _setup(ctx: object, inputs: tuple, output: tuple) -> None:
    ctx.grad = output[1].detach()  # type: ignore[attr-defined]


def _backward(ctx: object, grad_y: torch.Tensor, _grad_g: torch.Tensor) -> tuple:
    return grad_y * ctx.grad, None  # type: ignore[attr-defined]


_square_with_grad.register_autograd(_backward, setup_context=_setup)


class PrecomputedGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return _square_with_grad(h, h.requires_grad)[0]


class Ramp(nn.Module):
    """A ramp from a learnt start: eager gives ``linspace`` no gradient for it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.start = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ramp = torch.linspace(self.start, 2.0, 8)
        return self.lin(x) * ramp + self.start


@pytest.mark.parametrize("make", [PrecomputedGrad, Ramp])
@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_trains_as_eager(make: type, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(4, 8, generator=g),), torch.randn(4, 8, generator=g))
            for _ in range(3)]
    w = Workload(model, F.mse_loss, data[0], make.__name__)
    ref = reference(w, SGD, data)
    for method in ("auto", "data"):
        plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, f"local:{shape[0] * shape[1]}", mesh_shape=shape,
                        method=method, alpha=(1.0, 1.0), beta=(1.0, 1.0), memory_budget_gb=0)
        for r in run_emulated(train_rank, shape, plan, w, data,
                              capture(w.model, w.loss_fn, w.example_batch)):
            assert_matches(r, ref, plan, SGD)
