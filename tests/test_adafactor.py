"""Adafactor (torch.optim.Adafactor, the optimizer of Alpa's MoE runs): its factored state in the
cost model, and its update on shards equal to single-device training under every plan family
and under random plans. Unlike Adam it is not elementwise: its row and column statistics and the
parameter's and update's RMS are sums over whole parameters, completed across shards by the
all-reduces the plan lists (`meshplan.lower.factored_stats`)."""

from __future__ import annotations

import pytest
import torch

import meshplan.api as api
from meshplan.cost.memory import OptimizerState
from meshplan.lower.factored_stats import factored_buckets, update_dims
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec, optimizer_spec
from meshplan.zoo.spec import build_workload
from oracle import (GPT, MLP, assert_matches, batches, cpu_capture, make_plan, meta_workload,
                    reference, seeded_run, train_rank)
from random_plans import random_plan

AF = OptimizerSpec("adafactor", lr=1e-2, weight_decay=0.01)
MOE = "moe:hidden=16,layers=1,heads=2,experts=4,seq=8,vocab=32,batch=4"
CASES = [(m, s) for m in ("data", "megatron", "zero2", "zero3") for s in ((1, 2), (1, 4))] + \
    [("megatron", (2, 2)), ("auto", (2, 2))]


def _check(spec: str, plan, opt: OptimizerSpec = AF, microbatches: int = 1) -> None:
    if microbatches == 1:   # the session's seeded workload, oracle result and capture
        w, data, ref = seeded_run(spec, opt)
        captured = cpu_capture(spec)
    else:                   # traced at the micro-batch
        w = build_workload(spec, device="cpu", seed=0)
        data = batches(w, 3)
        ref = reference(w, opt, data, microbatches=microbatches)
        captured = None
    for r in run_emulated(train_rank, plan.mesh_shape, plan, w, data, captured):
        assert_matches(r, ref, plan, opt)


@pytest.mark.parametrize("spec", [MLP, GPT, MOE], ids=["mlp", "gpt", "moe"])
@pytest.mark.parametrize("method,shape", CASES, ids=[f"{m}-{s[0]}x{s[1]}" for m, s in CASES])
def test_plan_families_match_single_device_adafactor(spec: str, method: str, shape) -> None:
    # Abstract units for auto: the ILP then splits matmuls both ways, rows and columns.
    _check(spec, make_plan(spec, shape, method, AF, abstract=method == "auto"))


def test_micro_batches_with_adafactor() -> None:
    _check(GPT, make_plan(GPT, (1, 2), "megatron", AF, microbatches=2), microbatches=2)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (1, 4), (2, 2)], ids=str)
@pytest.mark.parametrize("spec", [MLP, GPT.replace("layers=2", "layers=1"), MOE],
                         ids=["mlp", "gpt", "moe"])
def test_random_plans_equal_single_device_adafactor(spec: str, shape, monkeypatch) -> None:
    # One meta model, workload, oracle result and capture per spec for its 4 mesh shapes.
    meta = meta_workload(spec)
    w, data, ref = seeded_run(spec, AF, 2)
    captured = cpu_capture(spec)
    split_both = 0
    for seed in range(4):
        plan = random_plan(meta.model, meta.loss_fn, AF, meta.example_batch, shape,
                           5000 + 100 * shape[0] + 10 * shape[1] + seed, monkeypatch,
                           abstract=seed % 2 == 1)
        split_both += any(p.spec.count("S") >= 2 or p.update != "replicated"
                          for p in plan.params)
        for r in run_emulated(train_rank, shape, plan, w, data, captured):
            assert_matches(r, ref, plan, AF)
    if shape == (2, 2):
        assert split_both, "some random plan should split a parameter twice (rows and columns)"


def test_statistics_buckets() -> None:
    # A (6, 10) weight split rows over axis 0 (2) and columns over axis 1 (4); a bias (10,)
    # columns over axis 1; a 3-D expert weight (4, 6, 10) experts over axis 0 only.
    mesh = (2, 4)
    shapes = [(6, 10), (10,), (4, 6, 10)]
    dims = [((0,), (1,)), ((1,),), ((0,), (), ())]
    got = {(b.round, b.axes): [(p.param, p.what, p.numel) for p in b.pieces]
           for b in factored_buckets(shapes, dims, mesh)}
    assert got == {
        (1, (0,)): [(0, "col", 3), (2, "param_sq", 1)],          # 10 columns / 4 -> 3 (ceil)
        (1, (0, 1)): [(0, "param_sq", 1)],
        (1, (1,)): [(0, "row", 3), (1, "param_sq", 1)],          # 6 rows / 2
        (2, (0,)): [(0, "row_sum", 1)],
        (3, (0,)): [(2, "update_sq", 1)],
        (3, (0, 1)): [(0, "update_sq", 1)],
        (3, (1,)): [(1, "update_sq", 1)],
    }
    # ZeRO splits the updated tensor's dim 0 further over the data-parallel axes.
    assert update_dims(((1,), ()), "zero2", (0,)) == ((1, 0), ())
    assert update_dims(((1,), ()), "replicated", (0,)) == ((1,), ())


def test_factored_state_in_the_cost_model() -> None:
    state = OptimizerSpec("adafactor").state()
    assert state == OptimizerState(0.0, factored=True)
    assert state.bytes_per_element((1024, 4096)) == pytest.approx(4 * (1024 + 4096) / 4096 / 1024)
    assert state.bytes_per_element((4096,)) == 4.0
    assert OptimizerSpec("adamw").state().bytes_per_element((1024, 4096)) == 8.0
    # A plan's memory: 8 B per parameter (fp32 value and gradient) plus the statistics, half
    # of Adam's 16.
    w = build_workload(GPT.replace("hidden=32", "hidden=256"), device="meta")
    mem = {o: api.plan(w.model, w.loss_fn, o, w.example_batch, "local:1",
                       mesh_shape=(1, 1), method="data",
                       memory_budget_gb=0).predicted["peak_memory_bytes"]
           for o in ("adafactor", "adamw")}
    params = sum(p.numel() for p in w.model.parameters())
    assert mem["adamw"] - mem["adafactor"] == pytest.approx(8 * params, rel=0.02)


def test_torch_adafactor_is_described_and_its_unsupported_options_refused() -> None:
    p = [torch.zeros(3, 2, requires_grad=True)]
    spec = optimizer_spec(torch.optim.Adafactor(p, lr=0.02, beta2_decay=-0.7, eps=(1e-30, 1e-3),
                                                d=2.0, weight_decay=0.1))
    assert spec == OptimizerSpec("adafactor", 0.02, weight_decay=0.1, beta2_decay=-0.7,
                                 eps1=1e-30, eps2=1e-3, d=2.0)
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    assert optimizer_spec("adafactor").lr == 1e-2   # torch's default, not Adam's
    for opt in (torch.optim.Adafactor(p, maximize=True), torch.optim.Adam(p, amsgrad=True),
                torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5)):
        with pytest.raises(ValueError, match="is not supported by meshplan's sharded update"):
            optimizer_spec(opt)
