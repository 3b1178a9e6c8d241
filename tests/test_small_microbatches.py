"""Micro-batch counts whose micro-batch the model cannot train on (batch norm over one value
per channel): every planning method passes over them, and a count the user fixes says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as api
from meshplan.errors import MicrobatchError

BATCH = 8


def _norm_net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def _plan(**kw) -> api.Plan:
    batch = (torch.randn(BATCH, 16), torch.randn(BATCH, 4))
    return api.plan(_norm_net(), nn.functional.mse_loss, "sgd", batch, "p3.16xlarge:1x4",
                    **kw)


@pytest.mark.parametrize("method", ["auto", "inter-only", "intra-only", "megatron-grid",
                                    "megatron:dp=1,tp=2,pp=2"])
def test_counts_of_one_sample_are_passed_over(method: str) -> None:
    plan = _plan(method=method)
    assert plan.microbatches < BATCH   # at one sample a micro-batch batch norm cannot train


@pytest.mark.parametrize("method", ["inter-only", "megatron:dp=1,tp=2,pp=2"])
def test_a_fixed_count_of_one_sample_says_why(method: str) -> None:
    with pytest.raises(MicrobatchError, match=r"micro-batches of 1 sample \(8 micro-batches\)"
                       r": ValueError: Expected more than 1 value per channel"):
        _plan(method=method, microbatches=BATCH)
