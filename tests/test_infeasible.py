"""Infeasible budgets explain themselves: the smallest per-device memory any plan needs, what
it holds, and what would help -- for every method, at any scale."""

from __future__ import annotations

import re

import pytest

import meshplan.api as meshplan
from meshplan.cli import main
from meshplan.errors import InfeasiblePlanError
from meshplan.planner.intra.ilp import IlpProblem, min_memory
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"


@pytest.mark.parametrize("method", ["auto", "data", "zero3", "megatron"])
def test_every_method_states_the_smallest_memory_and_what_helps(method: str) -> None:
    w = build_workload(GPT, device="meta")
    free = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                         method=method, memory_budget_gb=0)
    with pytest.raises(InfeasiblePlanError) as info:
        meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4", method=method,
                      memory_budget_gb=1e-5)
    err = info.value
    assert 1e-5 * 2**30 < err.min_memory_bytes <= free.predicted["peak_memory_bytes"] * 1.000001
    text = str(err)
    assert re.search(r"smallest plan needs [\d.]+ GiB per device", text)
    assert "parameters, gradients and optimizer state" in text and "activations" in text
    assert ("more devices" in text) or ("batch about" in text)


def test_a_budget_just_above_the_minimum_is_feasible() -> None:
    w = build_workload(GPT, device="meta")
    with pytest.raises(InfeasiblePlanError) as info:
        meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                      memory_budget_gb=1e-5)
    need = info.value.min_memory_bytes
    plan = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                         memory_budget_gb=need * 1.0001 / 2**30)
    assert plan.predicted["peak_memory_bytes"] <= need * 1.0001


def test_the_largest_preset_on_too_few_devices_says_how_many(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    code = main(["plan", "gpt:preset=39b,batch=1024", "--cluster", "p3.16xlarge:1"])
    err = capsys.readouterr().err
    assert code != 0
    assert re.search(r"smallest plan needs [\d.]+ GiB per device", err), err
    assert re.search(r"use about [\d.]+x more devices than 8", err), err


def test_min_memory_holds_for_terabyte_sized_nodes() -> None:
    # Memory in bytes of a 1T-parameter model: the min-memory row must not lose its bound
    # variable to the solver's tolerances (it once proved such problems infeasible).
    problem = IlpProblem(node_costs=((0.0, 0.0), (0.0, 0.0)),
                         node_memory=((3e13, 1e13), (2e13, 4e13)), live_sets=((0, 1),))
    assert min_memory(problem) == pytest.approx(3e13)


def test_a_method_with_no_plan_at_any_memory_says_so() -> None:
    """Inter-only (data-parallel stages) finds no pipeline of a small-batch MoE on 8 devices
    whatever the memory: the error says that, and what to use, not "the smallest plan needs
    inf GiB"."""
    w = build_workload("moe:preset=2.4b,layers=2,batch=16", device="meta")
    with pytest.raises(InfeasiblePlanError) as info:
        meshplan.plan(w.model, w.loss_fn, "adafactor", w.example_batch, "p3.16xlarge:1",
                      method="inter-only", dtype="fp16")
    message = str(info.value)
    assert message.startswith("no plan exists at any memory budget")
    assert "'inter-only'" in message and "use method 'auto'" in message
    assert "inf GiB" not in message
