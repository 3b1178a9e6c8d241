"""The stage profiler prices its memory-trading variants ("lean", "deep", "tp") only on the
submeshes and logical shapes where the memory limit may bind (`StageProfiler.memory_may_bind`:
the fastest plans of all layers, held as one stage with the most micro-batches any stage
keeps in flight, exceed it): elsewhere every range's fastest plan fits, and a plan made
without them is the plan made with them."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.lower.schedules import make_schedule
from meshplan.planner.inter.interleave import MAX_CHUNKS
from meshplan.planner.inter.stage_problem import ClusterShape, most_in_flight, submesh_shapes
from meshplan.planner.intra.choices import IntraOptions
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=8"
# Between what the fastest plans of the whole model need on one device (about 10 MiB) and on
# two or four (7-8 MiB): memory binds on some submeshes and not on others.
BUDGET = 8.5 * 2**20
MICROBATCHES = 2


# Micro-batches of one sample, 32 of them: a pipeline of the 6 layers keeps at most 6 in
# flight. The fastest plans of the whole model need about 7.2 MiB with 6 kept, 14.8 with all
# 32 (a micro-batch of 16 tokens splits nowhere: the same on every submesh).
GPT_ONES = "gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=32"
BUDGET_ONES = 10 * 2**20


def _profiler(budget: float, spec: str = GPT, microbatches: int = MICROBATCHES,
              schedule: str = "gpipe", per_microbatch: bool = False) -> StageProfiler:
    """A profiler of ``spec``'s program (traced at one micro-batch's samples with
    ``per_microbatch``, else at the whole batch) on one host of 4 V100s."""
    w = build_workload(spec, device="meta")
    batch = split_microbatches(w.example_batch, microbatches)[0] if per_microbatch \
        else w.example_batch
    _, graph = capture(w.model, w.loss_fn, batch)
    graph = with_compute_dtype(graph, "fp16")
    return StageProfiler(graph, cluster_layers(graph, 6), parse_cluster_spec("p3.16xlarge:1x4"),
                         IntraOptions(), OptimizerState(), microbatches, budget,
                         schedule=schedule)


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


@pytest.mark.parametrize("layers,devices", [(6, 4), (12, 8), (24, 4), (48, 64)])
def test_no_stage_keeps_more_than_most_in_flight(layers: int, devices: int) -> None:
    """The bound holds for every pipeline the searches weigh: each 1F1B stage of S <= layers,
    devices stages, and each virtual stage of every interleaving whose chunks divide the
    layers, at several micro-batch counts; GPipe keeps them all."""
    for b in (1, 2, 3, 8, 32, 96, 1024):
        bound = most_in_flight("1f1b", layers, devices, b)
        assert bound <= b
        assert most_in_flight("gpipe", layers, devices, b) == b
        for s in range(1, min(layers, devices) + 1):
            assert max(min(s - i, b) for i in range(s)) <= bound
            for v in range(2, MAX_CHUNKS + 1):
                if layers % (v * s) or b % s or s < 2 or b > 96:
                    continue
                sched = make_schedule("interleaved", s, b, v)
                assert max(sched.in_flight_of(k) for k in range(s * v)) <= bound, (s, v, b)


def test_a_pipeline_keeps_its_stages_not_the_steps_micro_batches() -> None:
    """With 32 micro-batches of one sample, every micro-batch in flight binds on (1, 4) and
    the 6 a pipeline of 6 layers can keep do not: the fastest plans fit there."""
    kw = dict(spec=GPT_ONES, microbatches=32, per_microbatch=True)
    sub, shape = (1, 4), (1, 4)
    assert _profiler(BUDGET_ONES, **kw).memory_may_bind(sub, shape)
    prof = _profiler(BUDGET_ONES, schedule="1f1b", **kw)
    assert not prof.memory_may_bind(sub, shape)
    for a in range(6):
        for b in range(a + 1, 7):
            plain = [o for o in prof(a, b, sub) if o.label.logical_shape == shape
                     and not o.label.recompute]
            assert plain and all(o.memory_bytes(6) <= BUDGET_ONES for o in plain), (a, b)


@pytest.mark.parametrize("spec,budget,method,kw", [
    (GPT, BUDGET, "auto", {"microbatches": 2}), (GPT, BUDGET, "megatron-grid", {}),
    (GPT_ONES, BUDGET_ONES, "auto", {"microbatches": 32})],
    ids=["auto", "megatron-grid", "auto-32"])
def test_a_plan_is_the_same_without_the_variants(spec: str, budget: float, method: str,
                                                 kw: dict,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where memory cannot bind, skipping the variants changes no plan: the same stages,
    plans and predicted step."""
    w = build_workload(spec, device="meta")

    def plan():
        return api.plan(w.model, w.loss_fn, "adam", w.example_batch, "p3.16xlarge:1x4",
                        method=method, dtype="fp16", memory_budget_gb=budget / 2**30, **kw)

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
