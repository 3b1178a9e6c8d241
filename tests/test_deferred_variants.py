"""The stage search prices its memory-trading variants ("lean", "deep") only where a pipeline
that may win uses them (`StageProfiler.lazy`, `search._settled`): the DP weighs a lower bound
of each variant not priced yet (`StageProfiler._placeholder`), prices those its pipelines use,
and runs again. The bounds must bound, or a plan would be lost; a plan made so must be the
plan made with every variant priced."""

from __future__ import annotations

import pytest

import meshplan.api as api
import meshplan.planner.inter.search as search
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_problem import ClusterShape, submesh_shapes
from meshplan.planner.intra.choices import IntraOptions
from meshplan.zoo.spec import build_workload

# (model, cluster, budget GiB, micro-batches): memory binds on some submeshes, not on others.
CASES = [
    ("gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=8", "p3.16xlarge:1x4", 0.0059, 2),
    ("moe:hidden=64,layers=4,heads=4,experts=8,seq=32,vocab=256,batch=8", "p3.16xlarge:1x8",
     0.0195, 4),
    ("wresnet:layers=26,width=2,image=64,batch=8", "p3.16xlarge:1x4", 0.0049, 2),
]
FIELDS = ("latency", "recompute_latency", "state", "act", "inputs", "selective_latency",
          "selective_act")


def _profiler(spec: str, cluster: str, budget_gb: float, microbatches: int) -> StageProfiler:
    w = build_workload(spec, device="meta")
    _, graph = capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                              microbatches)[0])
    graph = with_compute_dtype(graph, "fp16")
    cl = parse_cluster_spec(cluster)
    return StageProfiler(graph, cluster_layers(graph, 4), cl, IntraOptions(), OptimizerState(),
                         microbatches, budget_gb * 2**30, schedule="1f1b", lazy=True)


@pytest.mark.parametrize("spec,cluster,budget,microbatches", CASES,
                         ids=[c[0].split(":")[0] for c in CASES])
def test_a_deferred_variants_bound_is_below_it_in_every_figure(spec: str, cluster: str,
                                                                 budget: float,
                                                                 microbatches: int) -> None:
    prof = _profiler(spec, cluster, budget, microbatches)
    cl = prof.cluster
    subs = submesh_shapes(ClusterShape(cl.num_hosts, cl.devices_per_host))
    prof.prefetch(tuple(subs), workers=1)
    deferred = set().union(*(prof.deferred_on(sub) for sub in subs))
    assert deferred, "memory binds somewhere: some variant is deferred"
    layers = range(prof.layering.num_layers)
    bounds = {(m, *d): prof._exact(m, m + 1, *d) for d in deferred for m in layers}
    assert all(b is not None for b in bounds.values())
    solves = prof.solves
    prof.reveal(deferred, workers=1)
    assert prof.solves > solves and not set().union(*(prof.deferred_on(s) for s in subs))
    priced = 0
    for (m, sub, shape, variant), bound in bounds.items():
        exact = prof._exact(m, m + 1, sub, shape, variant)
        if exact is None:   # no plan of that kind: the bound only let the DP look
            continue
        priced += 1
        for field in FIELDS:
            assert getattr(bound, field) <= getattr(exact, field) * (1 + 1e-9) + 1e-15, \
                (field, m, sub, shape, variant, bound, exact)
    assert priced


def _decisions(plan) -> list:
    plans = [s.plan for s in plan.stages] if plan.stages and plan.stages[0].plan else [plan]
    return [(s.layers, s.devices, s.mesh_shape, s.recompute, s.recompute_scope)
            for s in plan.stages] + [(p.ops, p.params) for p in plans]


@pytest.mark.parametrize("spec,cluster,budget,microbatches", CASES,
                         ids=[c[0].split(":")[0] for c in CASES])
def test_a_plan_is_the_plan_made_with_every_variant_priced(spec: str, cluster: str,
                                                           budget: float, microbatches: int,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The walk over micro-batch counts included (no count given): a count searched only to
    a bound, and the counts solved whole searched on, choose what pricing everything does."""
    w = build_workload(spec, device="meta")
    settled: list[str] = []
    solves = [0]
    one, solve = search._search_one, StageProfiler._solve

    def spy(graph_for, b, req, *rest):   # noqa: ANN001, ANN002 - the search's own signature
        out = one(graph_for, b, req, *rest)
        settled.append("bound" if out.bound else "whole" if out.whole else "best")
        return out

    def counted(self, *args):   # noqa: ANN001, ANN002 - the profiler's own signature
        solves[0] += 1
        return solve(self, *args)

    monkeypatch.setattr(search, "_search_one", spy)
    monkeypatch.setattr(StageProfiler, "_solve", counted)   # (tests price in-process)

    def plan():
        solves[0] = 0
        out = api.plan(w.model, w.loss_fn, "adam", w.example_batch, cluster, dtype="fp16",
                       memory_budget_gb=budget)
        return out, solves[0]

    (lazy, lazy_solves), walked = plan(), list(settled)
    monkeypatch.setattr(search, "LAZY_VARIANTS", False)
    eager, eager_solves = plan()
    print(spec, walked, lazy_solves, eager_solves)
    assert lazy_solves < eager_solves
    assert lazy.microbatches == eager.microbatches
    assert lazy.predicted["step_time_s"] == eager.predicted["step_time_s"]
    assert _decisions(lazy) == _decisions(eager)


@pytest.mark.parametrize("spec,cluster,budget,microbatches", CASES,
                         ids=[c[0].split(":")[0] for c in CASES])
def test_a_walked_count_is_priced_as_far_as_its_best(spec: str, cluster: str, budget: float,
                                                     microbatches: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk reads a count's best estimate only: its first search (no bound to beat, the
    walk's first count) stops once the best pipeline is priced, "whole" (the candidates within
    the margin priced too) is left to the counts solved whole, and searching on from there
    runs no DP again and gives the same best."""
    w = build_workload(spec, device="meta")
    asked: dict = {}

    def grab(graph_for, counts, req):   # noqa: ANN001 - the search's own signature
        asked.update(graph_for=graph_for, req=req)
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "search_pipeline", grab)
    with pytest.raises(KeyboardInterrupt):
        api.plan(w.model, w.loss_fn, "adam", w.example_batch, cluster, dtype="fp16",
                 memory_budget_gb=budget)
    monkeypatch.setenv("MESHPLAN_WORKERS", "1")
    first = search._search_one(asked["graph_for"], microbatches, asked["req"])
    assert not first.whole and not first.bound
    profiler = first.found.profiler
    runs = [0]
    dp = search.solve_stage_dp

    def counted(problem):   # noqa: ANN001 - the DP's own signature
        runs[0] += 1
        return dp(problem)

    monkeypatch.setattr(search, "solve_stage_dp", counted)
    revealed = set(profiler._revealed)
    again = first.again(float("inf"), True)
    assert again.whole and again.estimate == first.estimate
    assert again.found.solution.stages == first.found.solution.stages
    # No DP ran for what the first search knew; one more per round of reveals the margin took.
    assert runs[0] == 0 if profiler._revealed == revealed else runs[0] > 0
