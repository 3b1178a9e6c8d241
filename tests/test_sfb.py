"""Sufficient-factor broadcasting (HAP §2.5.2): which weights it applies to, the gradient it
computes, when the planner takes it and what the plan says it moves. Plans using it train like
one device in tests/test_hetero_equivalence.py (synthesized and random, uneven shards, gloo)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import meshplan
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import mixed_cluster
from meshplan.cost.devices import DeviceType, Link
from meshplan.planner.hetero.astar import synthesize
from meshplan.planner.intra.ilp import solve
from meshplan.planner.intra.sfb import sfb_uses
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload
from hetero_cases import MODELS, RATIOS, four_speeds
from oracle import GPT, assert_matches, batches, reference, shared_capture, train_rank

SGD = OptimizerSpec("sgd", lr=0.05)


def graph_of(spec: str):
    return shared_capture(build_workload(spec, device="meta"))[1]


def by_state(graph) -> dict[str, str]:
    return {n.state_name: n.name for n in graph.nodes if n.role == "param"}


def test_weights_read_by_one_matmul_qualify_and_no_others() -> None:
    g = graph_of(GPT)
    uses, names = sfb_uses(g), by_state(g)
    # The tied embedding is read by the lookup and by the LM head: two uses, no SFB.
    assert names["wte.weight"] not in uses
    assert not any(names[s] in uses for s in names if s.endswith(("bias", "ln_1.weight")))
    for param, use in uses.items():
        assert g.by_name[use.consumer].op in ("mm", "bmm")
        assert len(g.by_name[param].out.shape) >= 2
    assert len(uses) == 6 * 2   # per block: q, k, v, out, fc_in, fc_out
    # Convolution weights do not qualify; the classifier's matmul does.
    conv = graph_of("wresnet:layers=26,channels=4,width=1,image=8,classes=10,batch=4")
    assert [len(conv.by_name[p].out.shape) for p in sfb_uses(conv)] == [2]


class Batched(nn.Module):
    """A weight read by bmm (one matrix per group), and one read through a transpose by mm."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5, 4))
        self.lin = nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.bmm(x, self.w))


def test_the_einsum_is_the_weight_gradient() -> None:
    torch.manual_seed(0)
    model, x = Batched(), torch.randn(3, 7, 5)
    _, g = capture(model, lambda out: out.square().mean(), ((x,), None))
    uses, names = sfb_uses(g), by_state(g)
    assert {names["w"], names["lin.weight"]} <= set(uses)
    h = torch.bmm(x, model.w).detach().requires_grad_(True)   # the consumers' factors
    y = model.lin(h)
    dh, dy = torch.autograd.grad(y.square().mean(), (h, y))
    model(x).square().mean().backward()
    got = torch.einsum(uses[names["w"]].equation, x, dh)
    assert torch.allclose(got, model.w.grad, atol=1e-6)
    # mm reads weight.t(): its einsum is the transpose's gradient.
    got = torch.einsum(uses[names["lin.weight"]].equation, h.detach().reshape(-1, 4),
                       dy.reshape(-1, 6))
    assert torch.allclose(got.t(), model.lin.weight.grad, atol=1e-6)


def _slow_cluster() -> meshplan.Cluster:
    dev = DeviceType("dev", {"float32": 1e13}, 16 * 2**30, 1e13, 1.0, 1.0)
    link = Link(1e9, 1e-5)
    return mixed_cluster("slow-link", [[dev] * 4], link, link)


def _mlp_plan(batch: int, sfb: str) -> meshplan.Plan:
    w = build_workload(f"mlp:layers=2,hidden=256,batch={batch}", device="meta")
    return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, _slow_cluster(),
                         mesh_shape=(1, 4), method="data", memory_budget_gb=0, sfb=sfb)


def test_auto_takes_sfb_when_the_factors_are_smaller_than_the_weight() -> None:
    # Data parallel on fast devices over a slow link, 256x256 weights: a batch of 4 moves 2·4·256 factor elements against 65 536 of gradient;
    # a batch of 2048, 2·2048·256 — more than the weight.
    small_auto, small_off = _mlp_plan(4, "auto"), _mlp_plan(4, "off")
    assert {p.update for p in small_auto.params if len(p.spec.split(",")) == 2} == {"sfb"}
    assert small_auto.predicted["step_time_s"] < 0.5 * small_off.predicted["step_time_s"]
    large = _mlp_plan(2048, "auto")
    assert "sfb" not in {p.update for p in large.params}


def test_the_plan_lists_the_gathered_factors_and_no_weight_sync() -> None:
    plan = _mlp_plan(4, "force")
    sfb = [p for p in plan.params if p.update == "sfb"]
    assert len(sfb) == 2 and all(tuple(p.sync_axes) == (1,) for p in sfb)
    backward = Counter((c.kind, c.bytes) for c in plan.collectives if c.phase == "backward"
                       for _ in range(c.count))
    # Per weight: its input (4 x 256 fp32) and its output gradient (4 x 256) gathered whole.
    assert backward[("all_gather", 4 * 256 * 4)] == 2 * 2
    update = [c for c in plan.collectives if c.phase == "update"]
    assert all(c.bytes < 256 * 256 * 4 for c in update)   # biases only, no weight all-reduce


def test_synthesis_finds_the_ilp_optimum_with_sfb_in_the_problem() -> None:
    from meshplan.planner.hetero.alternate import StepSettings, flat_choices, hetero_context
    from meshplan.planner.intra.choices import IntraOptions
    from meshplan.planner.intra.formulate import formulate
    cluster = four_speeds()
    for name in ("bert", "moe"):
        g = graph_of(MODELS[name])
        nc = flat_choices(g, cluster, IntraOptions(sfb="auto", full_split=False))
        assert any(c.mode == "sfb" for cs in nc.choices.values() for c in cs)
        form = formulate(nc, hetero_context(cluster, (0.4, 0.3, 0.2, 0.1), StepSettings()),
                         None)
        found, _ = synthesize(form.problem)
        assert found.objective == pytest.approx(solve(form.problem).objective, rel=1e-6)


def test_requests_sfb_cannot_honour_are_refused() -> None:
    w = build_workload(MODELS["mlp"], device="meta")
    args = (w.model, w.loss_fn, SGD, w.example_batch)
    with pytest.raises(ValueError, match="sfb must be one of off, auto, force"):
        meshplan.plan(*args, "local:4", mesh_shape=(1, 4), sfb="sometimes")
    with pytest.raises(ValueError, match="DDP"):
        meshplan.plan(*args, four_speeds(), method="dp-even", sfb="auto")
    with pytest.raises(ValueError, match="single-stage plans"):
        meshplan.plan(*args, "local:4", sfb="force")


def test_sfb_with_micro_batches_and_adamw_trains_like_one_device() -> None:
    # The factors are gathered and the gradient accumulated once per micro-batch; AdamW steps
    # the whole gradient every rank computed alike.
    adamw = OptimizerSpec("adamw", lr=0.01)
    spec = MODELS["bert"]
    meta = build_workload(spec, device="meta")
    plan = meshplan.plan(meta.model, meta.loss_fn, adamw, meta.example_batch, four_speeds(),
                         method="hetero", axis_weights=RATIOS, memory_budget_gb=0, sfb="force",
                         microbatches=2, name=spec)
    assert plan.microbatches == 2 and sum(p.update == "sfb" for p in plan.params) == 12
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch, 2)[0])
    ref = reference(w, adamw, data, microbatches=2)
    for result in run_emulated(train_rank, plan.mesh_shape, plan, w, data, captured):
        assert_matches(result, ref, plan, adamw)
