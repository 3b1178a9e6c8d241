"""Planner decisions on 4 devices with unit α and β (issue 3's acceptance cases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.zoo.spec import Workload


def _conv_stack(num_layers: int, channels: int, batch: int, image: int, in_channels: int,
                batch_norm: bool) -> Workload:
    layers: list[nn.Module] = []
    cin = in_channels
    for _ in range(num_layers):
        layers.append(nn.Conv2d(cin, channels, 3, padding=1, bias=False))
        if batch_norm:
            layers.append(nn.BatchNorm2d(channels))
        layers.append(nn.ReLU())
        cin = channels
    with torch.device("meta"):
        model = nn.Sequential(*layers[:-1])
        x = torch.empty(batch, in_channels, image, image)
        target = torch.empty(batch, channels, image, image)
    return Workload(model, F.mse_loss, ((x,), target), "convs")


def _plan(w: Workload) -> meshplan.Plan:
    return meshplan.plan(w.model, w.loss_fn, "sgd", w.example_batch, "local:4", mesh_shape=(1, 4),
                         alpha=(1, 1), beta=(1, 1), memory_budget_gb=0)


def test_wide_convolutions_with_a_small_batch_split_channels() -> None:
    for num_layers in (4, 6):
        plan = _plan(_conv_stack(num_layers, 256, 2, 8, 256, batch_norm=False))
        convs = [o for o in plan.ops if o.op == "conv"]
        # Alternating output-channel and input-channel splits, as Megatron does for matmuls.
        assert [o.strategy for o in convs] == ["o:S1", "c:S1"] * (num_layers // 2)
        all_reduces = [c for c in plan.collectives if c.kind == "all_reduce"]
        assert sum(c.count for c in all_reduces) == num_layers - 1
        assert {c.phase for c in all_reduces} == {"forward", "backward"}
        assert all(c.kind == "all_reduce" for c in plan.collectives)


def test_narrow_convolutions_with_a_large_batch_are_data_parallel_with_synced_statistics() -> None:
    plan = _plan(_conv_stack(4, 8, 256, 8, 3, batch_norm=True))
    assert {o.strategy for o in plan.ops if o.op in ("conv", "batch_norm")} == {"n:S1"}
    norms = [o for o in plan.ops if o.op == "batch_norm"]
    assert len(norms) == 4 and all(o.sync_axes == (1,) for o in norms)
    # Mean, then squared deviations: two all-reduces of 8 float64 sums per layer, each way.
    stats = [c for c in plan.collectives if c.kind == "all_reduce" and c.bytes == 8 * 8]
    assert {(c.phase, c.count) for c in stats} == {("forward", 8), ("backward", 8)}
    assert {p.spec for p in plan.params} <= {"R", "R,R,R,R"}


def test_many_experts_are_split_over_devices_and_tokens_move_by_all_to_all() -> None:
    from meshplan.zoo.spec import build_workload
    w = build_workload("moe:hidden=64,layers=2,heads=4,experts=16,seq=64,vocab=128,batch=16")
    plan = _plan(w)
    params = {p.name: p for p in plan.params}
    for name in ("w_in", "b_in", "w_out", "b_out"):
        assert params[f"blocks.1.moe.{name}"].spec.startswith("S1"), name  # expert dim split
    attention = [p for n, p in params.items() if ".attn." in n]
    assert attention and all(set(p.spec.split(",")) == {"R"} for p in attention)
    assert all(p.sync_axes == (1,) for p in attention)  # data parallel: gradients all-reduced
    moves = {c.phase: c.count for c in plan.collectives if c.kind == "all_to_all"}
    assert moves == {"forward": 1, "backward": 1}
