"""Frozen parameters (``requires_grad=False``: a fine-tuned model's base, LoRA's) stay as they
are: every plan family and a pipeline update only the parameters one device's optimizer
updates, and each rank holds the frozen ones whole."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import meshplan.api as api
from oracle import plain_training, trained_states


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (B starts at zero)."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.B = nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


class Tuned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 16).requires_grad_(False)
        self.l1, self.l2 = LoraLinear(16, 32), LoraLinear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.l2(torch.relu(self.l1(self.emb(ids)))).mean(1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                           momentum=0.9)


def _data() -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, 30, (8, 5), generator=g),), torch.randint(0, 4, (8,), generator=g))
            for _ in range(3)]


def _one_device(data: list, microbatches: int = 1) -> tuple[list[float], dict]:
    model = Tuned()
    return plain_training(model, _optimizer(model), nn.functional.cross_entropy, data,
                          microbatches)


def _check(losses: list[float], state: dict, ref: tuple[list[float], dict]) -> None:
    assert losses == pytest.approx(ref[0], rel=1e-5)
    for k, v in ref[1].items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-7), k


def _plan(model: nn.Module, cluster: str, **kw: Any) -> api.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return api.plan(model, nn.CrossEntropyLoss(), _optimizer(model), _data()[0], cluster,
                        memory_budget_gb=0, dtype="fp32", **kw)


@pytest.mark.parametrize("shape,method", [((1, 2), "data"), ((2, 2), "megatron"),
                                          ((1, 4), "zero3"), ((2, 2), "auto")])
def test_only_the_trainable_parameters_are_updated(shape: tuple[int, int], method: str) -> None:
    model, data = Tuned(), _data()
    plan = _plan(model, f"local:{shape[0] * shape[1]}", mesh_shape=shape, method=method)
    assert {p.name for p in plan.params} == {n for n, p in model.named_parameters()
                                              if p.requires_grad}
    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, _one_device(data))


def test_a_pipeline_of_a_partly_frozen_model() -> None:
    model, data = Tuned(), _data()
    plan = _plan(model, "local:4", method="megatron:dp=2,tp=1,pp=2", microbatches=2,
                 num_layers=2)
    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, _one_device(data, 2))


def test_frozen_parameters_count_in_the_plans_memory() -> None:
    """Each rank holds the frozen weights whole: the plan's state (and so the simulator's
    memory, and the budget the search fits) counts them."""
    model = Tuned()
    plan = _plan(model, "local:2", mesh_shape=(1, 2), method="data")
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert plan.predicted["state_bytes"] >= frozen + trainable
