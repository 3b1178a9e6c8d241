"""Acceptance: a top-2 MoE router written with topk, one_hot, cumsum and einsums (as people
write it, not as the zoo's GShard layer avoids those ops) captures with every op signed, the
auto plan on (1,4) splits the experts on the expert dim, and it trains equal to one device."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.zoo.spec import Workload
from oracle import SGD, assert_matches, reference, train_rank

G, T, D, HID, E, SLOTS = 4, 8, 32, 128, 4, 4


class Top2Router(nn.Module):
    """gate logits -> softmax -> topk(2) -> one_hot -> cumsum slots in a capacity ->
    dispatch/combine einsums around experts of shape (E, d, h)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, D, HID) * D ** -0.5)
        self.w_out = nn.Parameter(torch.randn(E, HID, D) * HID ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, t, _ = x.shape
        probs = torch.softmax(self.gate(x), dim=-1)                     # (G, T, E)
        gates, expert = probs.topk(2, dim=-1)                           # (G, T, 2)
        choice = F.one_hot(expert, E).to(x.dtype)                       # (G, T, 2, E)
        # Slots: first choices of a group queue before its second choices.
        queue = choice.transpose(1, 2).reshape(g, 2 * t, E)
        position = (torch.cumsum(queue, dim=1) - queue).reshape(g, 2, t, E).transpose(1, 2)
        keep = choice * (position < SLOTS).to(x.dtype)
        slot = F.one_hot((position * keep).sum(-1).long(), SLOTS).to(x.dtype)   # (G, T, 2, C)
        dispatch = torch.einsum("gtke,gtkc->gtec", keep, slot)
        combine = torch.einsum("gtk,gtke,gtkc->gtec", gates, keep, slot)
        tokens = torch.einsum("gtec,gtd->egcd", dispatch, x)            # (E, G, C, d)
        hidden = F.gelu(torch.einsum("egcd,edh->egch", tokens, self.w_in))
        out = torch.einsum("egch,ehd->egcd", hidden, self.w_out)
        return x + torch.einsum("gtec,egcd->gtd", combine, out)


def _workload() -> tuple[Workload, list]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    data = [((torch.randn(G, T, D, generator=gen),), torch.randn(G, T, D, generator=gen))
            for _ in range(3)]
    return Workload(Top2Router(), F.mse_loss, data[0], "top2-router"), data


def test_router_captures_with_every_op_signed() -> None:
    w, _ = _workload()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, graph = capture(w.model, w.loss_fn, w.example_batch)
    ops = {n.op for n in graph.nodes}
    assert {"topk", "cumsum", "eq", "softmax", "bmm"} <= ops, ops
    assert graph.unsupported_ops == ()


def test_auto_plan_splits_experts_and_trains_like_one_device() -> None:
    w, data = _workload()
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4", mesh_shape=(1, 4),
                    method="auto", memory_budget_gb=0)
    specs = {p.name: p.spec for p in plan.params}
    for name in ("w_in", "w_out"):
        assert specs[name].split(",")[0] == "S1", specs   # the expert dim E over the 4 devices
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, (1, 4), plan, w, data):
        assert_matches(r, ref, plan, SGD)
