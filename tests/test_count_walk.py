"""The walk over micro-batch counts (`search._CountSearch`): under "auto", a count whose fastest
pipeline is one stage ends the walk down, the fewer micro-batches left to one stage's own plan
(`api._weighs_intra_only`) and to the probe where a micro-batch gives each device a sample —
and auto's plan is still as fast as the best of planning each
count alone. Methods whose strategies depend on the batch dividing the devices (inter-only's
data parallelism) walk the counts down as before."""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace
from typing import Callable

import pytest

import meshplan.api as api
import meshplan.planner.inter.search as search
from meshplan.planner.memory_floor import CountFloors
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload

SGD = OptimizerSpec("sgd", lr=0.1)


@pytest.mark.parametrize("spec,cluster,method,searched_counts", [
    # 4 samples on 8 devices: no count gives every device one, so there is no probe.
    ("mlp:layers=2,hidden=64,batch=4", "p3.16xlarge:1x8", "auto", [4]),
    # Micro-batches of fewer samples than devices cannot be data parallel: inter-only's
    # one stage is then replicated, with no gradient all-reduce across hosts, and fastest
    # at 8 of 16 counts; its strategies do not grow with the batch, so it walks down.
    ("mlp:layers=4,hidden=256,batch=16", "p3.16xlarge:2x2", "inter-only", [16, 8, 4]),
])
def test_one_stage_ends_the_walk_down(spec: str, cluster: str, method: str,
                                      searched_counts: list[int],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = build_workload(spec, device="meta")
    searched: list[int] = []
    one = search._search_one

    def spy(graph_for, b, req, *rest):   # noqa: ANN001, ANN002 - the search's own signature
        searched.append(b)
        return one(graph_for, b, req, *rest)

    monkeypatch.setattr(search, "_search_one", spy)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method)
    assert plan.num_stages == 1 and searched == searched_counts
    monkeypatch.setattr(search, "_search_one", one)
    counts = api._microbatch_counts("auto", int(spec.rsplit("=", 1)[1]))
    each = {b: api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method,
                        microbatches=b).predicted["step_time_s"] for b in counts}
    assert plan.predicted["step_time_s"] <= min(each.values()) * (1 + 1e-9), (plan.microbatches,
                                                                              each)


@pytest.mark.parametrize("first_solves_to,second_solved", [
    (9.0, False),    # 10.5 is within 8 % of the first estimate (10.0) but not of 9.0
    (10.0, True),    # ... and within 8 % of 10.0: still solved whole
])
def test_a_count_is_solved_whole_only_within_the_margin_of_the_best_solved_plan(
        first_solves_to: float, second_solved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts are solved whole fastest estimate first; a further count only while its
    estimate is within `REFINE_MARGIN` of the best plan solved so far that fits (an
    estimate by parts misjudges by up to that margin, and what it must beat is known)."""

    from meshplan.planner.inter.to_plan import FoundPipeline

    def searched(count: int, estimate: float, solves_to: float) -> search._Searched:
        profiler = SimpleNamespace(count=count, solves_to=solves_to)
        found = FoundPipeline(SimpleNamespace(total_latency=estimate), profiler, "f", ())
        return search._Searched(found, ())

    solved: list[int] = []

    def solved_whole(profiler, round_, req):   # noqa: ANN001 - the search's own signature
        solved.append(profiler.count)
        return SimpleNamespace(total_latency=profiler.solves_to), True

    monkeypatch.setattr(search, "_whole_round", lambda profiler, candidates, req: None)
    monkeypatch.setattr(search, "_solved_whole", solved_whole)
    counts = SimpleNamespace(tried={8: searched(8, 10.0, first_solves_to),
                                    4: searched(4, 10.5, 9.5), 2: None})
    assert search.REFINE_MARGIN == 0.08
    best = search._solved_best(counts, SimpleNamespace(method="equal-layer", budget=None))
    assert solved == ([8, 4] if second_solved else [8])
    assert best.solution.total_latency == min(first_solves_to, 9.5 if second_solved else 99)
    assert best.estimated_s == (10.5 if second_solved and first_solves_to > 9.5 else 10.0)


def test_one_stage_counts_below_the_memory_floor_are_not_solved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-stage walk up from the fewest micro-batches skips, unsolved, the counts
    whose memory floor (`memory_floor.CountFloors`) is over the budget: the same plan as
    solving each of them to find it infeasible."""
    w = build_workload("gpt:hidden=32,layers=2,heads=4,seq=128,vocab=128,batch=32",
                       device="meta")
    solved: list[int] = []
    step = api._plan_step

    def spy(*args, **kwargs):   # noqa: ANN002, ANN003 - `_plan_step`'s own signature
        solved.append(args[-1].microbatches)
        return step(*args, **kwargs)

    monkeypatch.setattr(api, "_plan_step", spy)

    def plan() -> api.Plan:
        return api.plan(w.model, w.loss_fn, SGD, w.example_batch, "p3.16xlarge:1x4",
                        method="intra-only", memory_budget_gb=1 / 1024, dtype="fp32")

    skipped = plan()
    assert solved == [8]   # floors of 1, 2 and 4 micro-batches: 4.8, 2.4 and 1.3 MiB
    solved.clear()
    monkeypatch.setattr(CountFloors, "may_fit", lambda self, b: True)
    every = plan()
    assert solved == [1, 2, 4, 8]
    assert skipped.microbatches == every.microbatches == 8
    assert skipped.predicted == every.predicted


def _fits_recorded(monkeypatch: pytest.MonkeyPatch, budget_gb: float
                   ) -> tuple[list[tuple[int, float]], Callable[[], api.Plan]]:
    """The (micro-batches, step before fitting) of each plan the walk fits under the budget
    as simulated, as they come, and a single-stage plan of a small GPT on 8 V100s under
    ``budget_gb`` that records them."""
    w = build_workload("gpt:hidden=64,layers=2,heads=4,seq=128,vocab=256,batch=32",
                       device="meta")
    fitted: list[tuple[int, float]] = []
    within = api._within_as_simulated

    def spy(plan, *args, **kwargs):   # noqa: ANN001, ANN002, ANN003 - its own signature
        fitted.append((plan.microbatches, plan.predicted["step_time_s"]))
        return within(plan, *args, **kwargs)

    monkeypatch.setattr(api, "_within_as_simulated", spy)
    return fitted, lambda: api.plan(w.model, w.loss_fn, OptimizerSpec.from_dict(
        {"kind": "adamw"}), w.example_batch, "p3.16xlarge:1x8", method="intra-only",
        memory_budget_gb=budget_gb, dtype="fp32")


def test_a_count_slower_than_a_fitting_one_is_not_fitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-stage walk up does not fit under the budget as simulated (more solves) a
    count whose plan is already slower than an earlier count's that fits: fitted it would be
    no faster, and the walk stops there either way. The same plan as fitting it, one fitting
    fewer."""
    fitted, plan = _fits_recorded(monkeypatch, 2 / 1024)
    skipped = plan()
    kept = list(fitted)
    fitted.clear()
    monkeypatch.setattr(api, "FITTED_LOSES", math.inf)   # every count over the budget fitted
    every = plan()
    assert len(fitted) == len(kept) + 1
    extra = Counter(s for _, s in fitted) - Counter(s for _, s in kept)   # in any order
    assert len(extra) == 1 and next(iter(extra)) > 1.01 * skipped.predicted["step_time_s"]
    assert skipped.microbatches == every.microbatches
    assert skipped.predicted == every.predicted


def test_the_first_counts_fit_waits_until_the_walk_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-stage walk fits its first count's plan under the budget as simulated only
    when one of its decisions needs it: fitting only slows a plan, so where a later count's
    fitted plan is faster than the first's before fitting, the first is never fitted. The
    same plan as fitting every count as it comes, one fitting fewer."""
    fitted, plan = _fits_recorded(monkeypatch, 1.5 / 1024)
    lazy = plan()
    lazily = list(fitted)
    fitted.clear()
    add = api._FitWhenNeeded.add

    def at_once(self, one, key):   # noqa: ANN001 - the method's own signature
        if one.fit is not None:
            done, excess = one.fit()
            one, key = api._OneStage(done, excess, one.walks_on), api._walk_key(done, excess)
        add(self, one, key)

    monkeypatch.setattr(api._FitWhenNeeded, "add", at_once)
    every = plan()
    assert ([p[0] for p in lazily], [p[0] for p in fitted]) == ([32], [16, 32])
    assert lazy.microbatches == every.microbatches == 32
    assert lazy.predicted == every.predicted


def _walk_plan(step: float) -> SimpleNamespace:
    return SimpleNamespace(predicted={"step_time_s": step})


def test_fitting_when_needed_decides_as_fitting_at_once() -> None:
    """`api._FitWhenNeeded` on random walks (counts that fit, counts to fit whose fitted plan
    is slower than their bound and may still be over the budget, ties included): whether a
    plan that fits beats a step, whether a count so far ranks no worse than a new one, and
    its best count are those of the same counts fitted as they came."""
    rng = random.Random(27)
    for _ in range(300):
        walk, eager = api._FitWhenNeeded(), []
        for _ in range(rng.randint(1, 5)):
            step = rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 4.0)])
            if rng.random() < 0.5:   # fits as it is
                excess = rng.choice([0.0, -1.0])
                one = api._OneStage(_walk_plan(step), excess, True)
                done = (one.plan, excess)
            else:
                slower = _walk_plan(step * rng.choice([1.0, 1.5, rng.uniform(1.0, 3.0)]))
                excess = rng.choice([0.0, 0.0, 2.0, rng.uniform(0.1, 3.0)])
                one = api._OneStage(_walk_plan(step), 1.0, True, lambda r=(slower, excess): r)
                done = (slower, excess)
            walk.add(one, api._walk_key(one.plan, one.excess))
            eager.append((api._walk_key(*done), len(eager), done[0]))
        top = min(eager, key=lambda e: e[:2])

        def beaten() -> None:
            probe = rng.choice([0.5, 1.0, 2.0, 3.0, rng.uniform(0.5, 5.0)])
            piped = rng.choice([None, rng.uniform(0.5, 5.0)])
            known = [s for s in (piped, None if top[0][0] else top[2].predicted["step_time_s"])
                     if s is not None]
            assert walk.beaten(piped, probe) == \
                (bool(known) and probe > (1 + api.FITTED_LOSES) * min(known))

        def beats() -> None:
            key = (False, 0.0, rng.choice([0.5, 1.0, 2.0, 3.0, rng.uniform(0.5, 5.0)]))
            assert walk.beats(key) == any(k <= key for k, _, _ in eager)

        def best() -> None:
            found = walk.best()
            assert found is not None and found[0] == top[0] and found[1] is top[2]

        # In any order: an earlier question's fits must not be what answers a later one.
        questions = [beaten, beats, best]
        rng.shuffle(questions)
        for ask in questions:
            ask()
