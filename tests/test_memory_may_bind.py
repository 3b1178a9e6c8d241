"""The stage profiler prices its memory-trading variants ("lean", "deep", "tp") only on the
submeshes and logical shapes where the memory limit may bind (`StageProfiler.memory_may_bind`:
the fastest plans of all layers, held as one stage with every micro-batch in flight, exceed
it): there every range's fastest plan fits, and a plan made without them is the plan made with
them."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_problem import ClusterShape, submesh_shapes
from meshplan.planner.intra.choices import IntraOptions
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=8"
# Between what the fastest plans of the whole model need on one device (about 10 MiB) and on
# two or four (7-8 MiB): memory binds on some submeshes and not on others.
BUDGET = 8.5 * 2**20
MICROBATCHES = 2


def _profiler(budget: float) -> StageProfiler:
    w = build_workload(GPT, device="meta")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    graph = with_compute_dtype(graph, "fp16")
    return StageProfiler(graph, cluster_layers(graph, 6), parse_cluster_spec("p3.16xlarge:1x4"),
                         IntraOptions(), OptimizerState(), MICROBATCHES, budget)


def _pairs(prof: StageProfiler) -> list:
    return [(sub, shape) for sub in submesh_shapes(ClusterShape(1, 4))
            for shape in prof.shapes(sub)]


def test_where_memory_cannot_bind_every_ranges_fastest_plan_fits() -> None:
    prof = _profiler(BUDGET)
    binds = {pair: prof.memory_may_bind(*pair) for pair in _pairs(prof)}
    assert any(binds.values()) and not all(binds.values()), binds
    n = prof.layering.num_layers
    for (sub, shape), may in binds.items():
        listed = set()
        for a in range(n):
            for b in range(a + 1, n + 1):
                options = [o for o in prof(a, b, sub) if o.label.logical_shape == shape]
                listed |= {o.label.budget for o in options}
                if not may:
                    plain = [o for o in options if not o.label.recompute]
                    assert plain and all(o.memory_bytes(MICROBATCHES) <= BUDGET
                                         for o in plain), (sub, shape, a, b)
        assert ("lean" in listed) == may, (sub, shape, listed)


def test_a_lower_budget_prices_them_again() -> None:
    """A DP refitted under a lower budget (`search._refitted`) is shown them where it may
    now bind."""
    prof = _profiler(BUDGET)
    sub, shape = (1, 4), (1, 4)
    assert not prof.memory_may_bind(sub, shape)
    assert {o.label.budget for o in prof(0, 6, sub)} == {"free"}
    prof.bind_below(BUDGET / 2)
    assert prof.memory_may_bind(sub, shape)
    assert {"free", "lean", "tp"} <= {o.label.budget for o in prof(0, 6, sub)}


@pytest.mark.parametrize("method,kw", [("auto", {"microbatches": 2}), ("megatron-grid", {})],
                         ids=["auto", "megatron-grid"])
def test_a_plan_is_the_same_without_the_variants(method: str, kw: dict,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where memory cannot bind, skipping the variants changes no plan: the same stages,
    plans and predicted step."""
    w = build_workload(GPT, device="meta")

    def plan():
        return api.plan(w.model, w.loss_fn, "adam", w.example_batch, "p3.16xlarge:1x4",
                        method=method, dtype="fp16", memory_budget_gb=BUDGET / 2**30, **kw)

    skipped = plan()
    monkeypatch.setattr(StageProfiler, "memory_may_bind",
                        lambda self, submesh, shape: self.memory_limit is not None)
    priced = plan()
    assert skipped.predicted["step_time_s"] == priced.predicted["step_time_s"]
    assert skipped.microbatches == priced.microbatches
    assert _decisions(skipped) == _decisions(priced)


def _decisions(plan) -> list:
    """Each stage's layers, devices, mesh, recomputation and every op's and parameter's
    decision (a single-stage plan: its own)."""
    plans = [s.plan for s in plan.stages] if plan.stages and plan.stages[0].plan else [plan]
    return [(s.layers, s.devices, s.mesh_shape, s.recompute) for s in plan.stages] + \
        [(p.ops, p.params) for p in plans]
