"""`extract.plan_collectives` (what the pricing of recomputation asks of a plan) lists the
collectives `extract` does, for every plan the stage pricing prices a replay of: ZeRO-2 and
ZeRO-3 (their gathers in the forward), data, tensor and expert parallel, several
micro-batches."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.planner.intra import extract as ex
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload


# Budgets under what the fastest plans of the whole model need on each submesh, so that the
# plans which trade speed for memory (ZeRO's) are priced too (`StageProfiler.memory_may_bind`).
@pytest.mark.parametrize("spec,cluster,kwargs", [
    ("gpt:hidden=128,layers=2,heads=4,seq=32,vocab=256,batch=16", "p3.16xlarge:1x4",
     {"memory_budget_gb": 0.008, "microbatches": 2}),
    ("moe:hidden=128,layers=2,heads=4,seq=32,vocab=256,experts=4,batch=16", "p3.16xlarge:2x2",
     {"memory_budget_gb": 0.03, "microbatches": 2}),
])
def test_plan_collectives_are_extracts(spec: str, cluster: str, kwargs: dict,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    priced = []
    replay = ex.recompute_extra_s

    def spy(form, choices, real, recomputed=None):   # noqa: ANN001 - its own signature
        priced.append((form, choices, real))
        return replay(form, choices, real, recomputed)

    monkeypatch.setattr("meshplan.planner.inter.stage_costs.recompute_extra_s", spy)
    w = build_workload(spec, device="meta")
    api.plan(w.model, w.loss_fn, OptimizerSpec("adam", lr=0.1), w.example_batch, cluster,
             **kwargs)
    assert len(priced) > 10
    kinds = set()
    for form, choices, real in priced:
        listed = ex.extract(form, choices, real).collectives
        assert ex.plan_collectives(form, choices) == listed
        kinds |= {(c.kind, c.phase) for c in listed}
    assert {("all_gather", "forward"), ("all_reduce", "update")} <= kinds, kinds
