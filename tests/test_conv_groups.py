"""Grouped and depthwise convolutions: whole groups split across devices, batches split."""

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


def separable_block(channels: int, expand: int) -> nn.Sequential:
    """MobileNet-v2's block: 1x1 expand, 3x3 depthwise, 1x1 project."""
    hidden = channels * expand
    return nn.Sequential(nn.Conv2d(channels, hidden, 1), nn.ReLU(),
                         nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden), nn.ReLU(),
                         nn.Conv2d(hidden, channels, 1))


def _case(model: nn.Module, x_shape: tuple[int, ...]) -> tuple[Workload, list]:
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(*x_shape, generator=g),), torch.randn(*x_shape, generator=g))
            for _ in range(3)]
    return Workload(model, F.mse_loss, data[0], "conv"), data


def _run(w: Workload, data: list, shape: tuple[int, int], method: str = "auto") -> api.Plan:
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4", mesh_shape=shape,
                    method=method, alpha=(1.0, 1.0), beta=(1.0, 1.0), memory_budget_gb=0)
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, shape, plan, w, data,
                          capture(w.model, w.loss_fn, w.example_batch)):
        assert_matches(r, ref, plan, SGD)
    return plan


def test_depthwise_separable_blocks_all_reduce_once_each() -> None:
    torch.manual_seed(0)
    blocks = 2
    model = nn.Sequential(*[separable_block(64, 4) for _ in range(blocks)])
    w, data = _case(model, (2, 64, 6, 6))
    plan = _run(w, data, (1, 4))
    assert not plan.options["unsupported_ops"]
    forward = [c for c in plan.collectives if c.phase == "forward"]
    assert [(c.kind, c.count) for c in forward] == [("all_reduce", blocks)], forward
    depthwise = plan.param("0.2.weight")
    assert depthwise.spec.startswith("S1"), depthwise  # whole groups on each device


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_convolution_batch_and_group_splits(groups: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, groups=groups), nn.ReLU(),
                          nn.Conv2d(16, 8, 3, padding=1, groups=groups))
    w, data = _case(model, (4, 8, 6, 6))
    _run(w, data, (2, 2))
    _run(w, data, (2, 2), method="data")


def test_grouped_conv_signature_splits_only_whole_groups_and_batch() -> None:
    from meshplan.capture.signature_rules import OpCall, conv_rule
    # Depthwise 3x3 over 64 channels: input channels (g=64, c=1), weight rows (g=64, o=1).
    call = OpCall("convolution", ((2, 64, 6, 6), (64, 1, 3, 3)), (2, 64, 6, 6),
                  (None, None, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 64), ())
    sig = conv_rule(call).sig
    assert set(sig.splittable_atoms()) == {"n", "g"}
    assert (sig.size("g"), sig.size("c"), sig.size("o")) == (64, 1, 1)
    # Grouped, not depthwise: 4 groups of 8 in, 4 out channels each; c and o never split.
    call = OpCall("convolution", ((2, 32, 6, 6), (16, 8, 3, 3)), (2, 16, 6, 6),
                  (None, None, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4), ())
    sig = conv_rule(call).sig
    assert set(sig.splittable_atoms()) == {"n", "g"}
    assert (sig.size("g"), sig.size("c"), sig.size("o")) == (4, 8, 4)
