"""Fan-out and tied weights: one value moved once for all its consumers, one parameter
synchronized once for all its uses, and the ILP charging exactly what runs."""

from __future__ import annotations

import pytest

from meshplan.plan.plan import Plan
from meshplan.planner.intra.fanout import param_sync
from oracle import GPT, SGD, alpha_beta_sum, make_plan
from test_equivalence_emulated import run_case

# Blocks with separate q, k and v projections of one layer-norm output.
QKV_GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
# Tied embedding whose lookup the auto plan on real costs keeps whole while the LM head splits.
TIED_GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=256,batch=8"


ACTIVATION_BYTES = 8 * 16 * 64 * 4  # batch x seq x hidden, fp32


def activation_all_reduces(plan: Plan, phase: str) -> int:
    return sum(c.count for c in plan.collectives if c.kind == "all_reduce"
               and c.phase == phase and c.bytes == ACTIVATION_BYTES)


def test_megatron_all_reduces_each_activation_gradient_once() -> None:
    plan = make_plan(QKV_GPT, (1, 4), "megatron", SGD, abstract=True)
    forward = activation_all_reduces(plan, "forward")
    assert forward == 5  # two row-parallel outputs per block, the vocabulary-split lookup
    assert activation_all_reduces(plan, "backward") == forward
    assert plan.objective == pytest.approx(alpha_beta_sum(plan), rel=1e-9)


@pytest.mark.parametrize("method", ["megatron", "auto"])
def test_objective_is_what_runs_and_equals_single_device(method: str) -> None:
    plan = make_plan(QKV_GPT, (1, 4), method, SGD, abstract=True)
    assert plan.objective == pytest.approx(alpha_beta_sum(plan), rel=1e-9)
    assert activation_all_reduces(plan, "backward") <= activation_all_reduces(plan, "forward")
    run_case(QKV_GPT, (1, 4), method, SGD, abstract=True)  # recorded == planned, per step


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_tied_embedding_gradient_counts_each_use_once(shape: tuple[int, int]) -> None:
    plan = make_plan(TIED_GPT, shape, "auto", SGD)
    wte = plan.param("wte.weight")
    assert wte.sync_axes, "the case must sync the tied weight (its head splits the batch)"
    run_case(TIED_GPT, shape, "auto", SGD)


def test_param_sync_rule() -> None:
    assert param_sync([(), (1,)]) == ((1,), ())
    assert param_sync([(1,), (0, 1), (1,)]) == ((0, 1), ((1,),))
    assert param_sync([(0,), (1,)]) == ((0,), ((1,),))
    assert param_sync([(), ()]) == ((), ())


def test_small_gpt_auto_plans_still_equal_single_device() -> None:
    run_case(GPT, (2, 2), "auto", SGD)
