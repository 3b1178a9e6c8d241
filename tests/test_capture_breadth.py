"""Models written without meshplan in mind: a top-2 router from topk/one_hot/cumsum/einsum,
data-dependent shapes refused clearly, capture from several threads at once."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import Workload
from oracle import assert_matches, record_counter, reference

SGD = OptimizerSpec("sgd", lr=0.1)


class Top2Router(nn.Module):
    """A GShard-style top-2 mixture of experts written from basic ops: a softmax gate, topk,
    one_hot, positions in each expert's buffer by cumsum, capacity dropping, einsum dispatch."""

    def __init__(self, d: int = 16, h: int = 32, experts: int = 4, capacity: int = 6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, h, generator=g) * 0.2)
        self.w_out = nn.Parameter(torch.randn(experts, h, d, generator=g) * 0.2)
        self.experts, self.capacity = experts, capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (groups, tokens, d)
        probs = self.gate(x).softmax(-1)
        gates, idx = probs.topk(2, dim=-1)                               # (g, s, 2)
        choice = F.one_hot(idx, self.experts).to(x.dtype)               # (g, s, 2, e)
        flat = choice.flatten(1, 2)                                      # first, second, ...
        position = (torch.cumsum(flat, dim=1) - 1.0) * flat              # slot in the expert
        position = position.unflatten(1, (x.shape[1], 2))
        kept = choice * (position < self.capacity).to(x.dtype)
        slot = F.one_hot(position.long().clamp(0, self.capacity - 1), self.capacity)
        dispatch = torch.einsum("gske,gskec->gsec", kept, slot.to(x.dtype))
        combine = torch.einsum("gsk,gske,gskec->gsec", gates, kept, slot.to(x.dtype))
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, x)
        hidden = torch.relu(torch.einsum("egcd,edh->egch", expert_in, self.w_in))
        expert_out = torch.einsum("egch,ehd->egcd", hidden, self.w_out)
        return torch.einsum("gsec,egcd->gsd", combine, expert_out)


def _router_case() -> tuple[Workload, list]:
    torch.manual_seed(0)
    model = Top2Router()
    g = torch.Generator().manual_seed(3)
    data = [((torch.randn(4, 8, 16, generator=g),), torch.randn(4, 8, 16, generator=g))
            for _ in range(3)]
    return Workload(model, F.mse_loss, data[0], "top2-router"), data


def test_top2_router_splits_experts_and_equals_single_device() -> None:
    w, data = _router_case()
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4", mesh_shape=(1, 4),
                    alpha=(1.0, 1.0), beta=(1.0, 1.0), memory_budget_gb=0)
    assert not plan.options["unsupported_ops"], plan.options["unsupported_ops"]
    assert plan.param("w_in").spec.startswith("S1") and plan.param("w_out").spec.startswith("S1")
    ref = reference(w, SGD, data)
    captured = capture(w.model, w.loss_fn, w.example_batch)
    from oracle import train_rank
    for r in run_emulated(train_rank, (1, 4), plan, w, data, captured):
        assert_matches(r, ref, plan, SGD)


class DroplessRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.gate(x).argmax(-1)
        tokens = torch.nonzero(chosen == 0)         # how many: known only from the data
        return x[tokens[:, 0]].sum() + self.gate.weight.sum()


def test_data_dependent_shapes_are_refused_with_the_op_and_the_module() -> None:
    model = DroplessRouter()
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"'nonzero.*DroplessRouter.*capacity"):
        api.plan(model, lambda out, t: out, SGD, ((x,), x), "local:2", memory_budget_gb=0)


def test_trainers_capture_in_threads_without_help() -> None:
    # Emulated ranks are threads; each Trainer traces the model itself, concurrently.
    w, data = _router_case()
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4", mesh_shape=(2, 2),
                    method="data", memory_budget_gb=0)

    def rank(comm, plan, w, data):
        tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
        return [tr.step(b) for b in data]

    ref_losses, _ = reference(w, SGD, data)
    for losses in run_emulated(rank, (2, 2), plan, w, data):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert threading.active_count() >= 1
