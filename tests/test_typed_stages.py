"""Pipelines on clusters of mixed hosts (issue 10, item 7): the stage DP with typed submeshes is
exact, slow devices get stages of their own, stages land on hosts of their type, and a typed
pipeline trains exactly like one device."""

from __future__ import annotations

import itertools
import math
import re
import random
import warnings

import pytest

import meshplan
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import mixed_cluster
from meshplan.cost.devices import DEVICE_TYPES, DeviceType, Link, link_preset
from meshplan.planner.inter.device_kinds import host_types, kind_layouts, kind_types
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_problem import (ClusterShape, DeviceKinds, PipelineProblem,
                                                  StageOption, pipeline_latency,
                                                  submesh_shapes)
from meshplan.plan.explain import explain
from meshplan.runtime.emulated import run_emulated_stages
from meshplan.sim.simulate import simulate
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload
from oracle import assert_matches, batches, reference
from test_pipeline_runtime import _rank

V100, P100 = DEVICE_TYPES["V100-SXM2-16GB"], DEVICE_TYPES["P100-SXM2-16GB"]


def _random_problem(rng: random.Random, layers: int, kinds: tuple[int, ...],
                    microbatches: int) -> tuple[PipelineProblem, dict]:
    """Hosts of two kinds and a mixed one; a stage's latency grows with its layers, shrinks
    with its hosts and depends on its kind, at random; some stages do not fit memory."""
    work = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    speed = {0: rng.uniform(1.5, 3.0), 1: 1.0, 2: rng.uniform(0.6, 1.0)}   # 2: mixed

    def profile(start: int, end: int, sub) -> tuple[StageOption, ...]:
        hosts, _, kind = sub
        lat = sum(work[start:end]) / (speed[kind] * hosts ** rng.uniform(0.7, 1.0))
        return (StageOption(lat, 1.0, rng.choice((0.5, 2.0)), label=(start, end, sub)),)

    table: dict = {}

    def cached(start: int, end: int, sub) -> tuple[StageOption, ...]:
        if (start, end, sub) not in table:
            table[(start, end, sub)] = profile(start, end, sub)
        return table[(start, end, sub)]

    problem = PipelineProblem(ClusterShape(1, len(kinds)), layers, cached, microbatches,
                              device_memory=5.0, kinds=DeviceKinds(kinds, ("fast", "slow")))
    return problem, table


def _brute_force(problem: PipelineProblem) -> float:
    """Every split of the layers into stages and of the positions into their hosts (of the
    DP's submesh sizes)."""
    layers, n, kinds = problem.num_layers, problem.cluster.num_devices, problem.kinds
    allowed = {h * d for h, d in submesh_shapes(problem.cluster)}
    best = math.inf
    for s in range(1, min(layers, n) + 1):
        for cuts in itertools.combinations(range(1, layers), s - 1):
            bounds = (0, *cuts, layers)
            for sizes in itertools.product(sorted(allowed), repeat=s):
                if sum(sizes) != n:
                    continue
                lat, at, ok = [], 0, True
                for i, hosts in enumerate(sizes):
                    kind = kinds.kind_of(at, hosts)
                    at += hosts
                    fitting = [o for o in problem.profile(bounds[i], bounds[i + 1],
                                                          (1, hosts, kind))
                               if problem.fits(o, problem.in_flight(i, s,
                                                                    problem.num_microbatches))]
                    if not fitting:
                        ok = False
                        break
                    lat.append(min(o.latency for o in fitting))
                if ok:
                    best = min(best, pipeline_latency(tuple(lat), problem.num_microbatches))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_typed_dp_is_exact(seed: int) -> None:
    rng = random.Random(seed)
    kinds = rng.choice([(0, 1, 1), (0, 0, 1, 1), (1, 1, 0, 0), (0, 1, 1, 1)])
    problem, _ = _random_problem(rng, rng.randint(2, 5), kinds, rng.randint(1, 4))
    try:
        found = solve_stage_dp(problem).total_latency
    except meshplan.errors.NoPipelineError:
        found = math.inf
    assert found == pytest.approx(_brute_force(problem), rel=1e-12)


def test_each_stage_is_of_the_kind_of_its_positions() -> None:
    for seed in range(6):
        rng = random.Random(100 + seed)
        kinds = (0, 0, 1, 1, 1)
        problem, _ = _random_problem(rng, 5, kinds, 3)
        sol = solve_stage_dp(problem)
        at = 0
        for s in sol.stages:
            assert s.kind == problem.kinds.kind_of(at, s.submesh[1])
            at += s.submesh[1]


def test_only_typed_shapes_some_positions_can_hold_are_asked() -> None:
    """HAP's 2 V100 hosts and 6 P100 (the DP's devices are hosts): no V100 stage of 4 or 8
    hosts, no P100 stage of 8, no mixed stage of one host; the rest in both host orders. The
    caller prices every shape asked, so a shape no stage can take is time for nothing."""
    base = ((1, 1), (1, 2), (1, 4), (1, 8))
    for kinds in ((0, 0, 1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 1, 1, 0, 0)):
        shapes = DeviceKinds(kinds, ("V100", "P100")).shapes(base)
        assert shapes == ((1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1), (1, 2, 2), (1, 4, 1),
                          (1, 4, 2), (1, 8, 2))


def _hosts(per_host: int, slow_hosts: int, fast=V100, slow=P100):
    return mixed_cluster("fast+slow", [[fast] * per_host] + [[slow] * per_host] * slow_hosts,
                         link_preset("pcie3"), Link(1.3e9, 50e-6))


def _device(name: str, flops: float) -> DeviceType:
    return DeviceType(name, {"float32": flops}, 16 * 2**30, flops, 1.0, 1.0)


# One fast device and three 4x slower, a host each on a slow network: a small GPT's weights
# cost more to all-reduce than its activations to pass between stages.
FAST, SLOW = _device("fast", 4e11), _device("slow", 1e11)


def test_host_layouts_put_each_type_together_both_ways() -> None:
    cl = _hosts(2, 3)
    types = host_types(cl)
    assert types == (V100, P100, P100, P100)
    kinds = kind_types(types, "fp32")
    assert kinds == (V100, P100)
    (fast_first, k1), (slow_first, k2) = kind_layouts(types, kinds)
    assert fast_first == (0, 1, 2, 3) and k1.kinds == (0, 1, 1, 1)
    assert slow_first == (1, 2, 3, 0) and k2.kinds == (1, 1, 1, 0)
    # A host of two types is not typed: it plans as its slowest device.
    assert host_types(mixed_cluster("m", [[V100, P100], [P100, P100]], link_preset("pcie3"),
                                    Link(1.3e9, 50e-6))) is None


GPT = "gpt:hidden=128,layers=4,heads=4,seq=16,vocab=128,batch=16"


def _typed_plan(spec: str, cluster, **kw) -> meshplan.Plan:
    w = build_workload(spec, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method="auto",
                             dtype="fp32", name=spec, **kw)


SGD = OptimizerSpec("sgd", lr=0.05)


def test_the_fast_host_gets_more_layers_and_its_own_stage() -> None:
    plan = _typed_plan(GPT, _hosts(1, 3, FAST, SLOW), num_layers=4, microbatches=8)
    assert plan.options["mixed_auto"]["chosen"] == "typed stages", plan.options["mixed_auto"]
    steps = plan.options["mixed_auto"]["step_s"]
    assert steps["typed stages"] < min(steps["uniform"], steps["hetero"])
    fast = [s for s in plan.stages if s.devices == (0,)]
    assert len(fast) == 1 and fast[0].plan.cluster["device"]["name"] == "fast"
    slow_layers = [s.layers[1] - s.layers[0] for s in plan.stages if s.devices != (0,)]
    assert fast[0].layers[1] - fast[0].layers[0] > max(slow_layers)
    assert re.search(rf"stage {fast[0].index}: layers \[\d, \d\) on devices 0 \[fast\]",
                     explain(plan)), explain(plan)
    assert "mixed devices    chose typed stages of hetero" in explain(plan)
    # The simulator runs each stage on its own device type (the fast stage priced as a slow
    # one would double the step); it differs from eq. 2 by the schedule's true bubble.
    assert simulate(plan).step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.1)


def test_a_typed_pipeline_trains_like_one_device() -> None:
    plan = _typed_plan(GPT, _hosts(1, 3, FAST, SLOW), num_layers=4, microbatches=8,
                       memory_budget_gb=0)
    assert plan.options["mixed_auto"]["chosen"] == "typed stages"
    w = build_workload(GPT, device="cpu", seed=0)
    data = batches(w, 2)
    captured = capture(w.model, w.loss_fn,
                       split_microbatches(w.example_batch, plan.microbatches)[0])
    results = run_emulated_stages(_rank, plan.stage_meshes(), plan, w, data, captured)
    ref = reference(w, SGD, data, microbatches=plan.microbatches)
    params: dict = {}
    for losses, state, *_ in results:
        params.update(state)
    assert_matches((results[0][0], params, []), ref, plan, SGD)


def test_hosts_of_the_slowest_type_are_priced_once_with_stages_spanning_types() -> None:
    """A stage spanning types is priced as the cluster's slowest device; where one type has
    exactly its figures (HAP's P100 against "the slowest of V100+P100", whose peak has the
    P100's efficiency folded in), the stage on that type's hosts costs the same and is
    priced once for both."""
    from meshplan.cost.cluster import Cluster
    from meshplan.cost.memory import OptimizerState
    from meshplan.cost.precision import with_compute_dtype
    from meshplan.planner.inter.clustering import cluster_layers
    from meshplan.planner.inter.stage_costs import StageProfiler
    from meshplan.planner.intra.choices import IntraOptions
    w = build_workload(GPT, device="meta")
    graph = with_compute_dtype(capture(w.model, w.loss_fn, w.example_batch)[1], "fp16")
    layering = cluster_layers(graph, 4)

    def profiler(cl: Cluster, kinds: tuple[DeviceType, ...] = ()) -> StageProfiler:
        return StageProfiler(graph, layering, cl, IntraOptions(optimizer="adamw"),
                             OptimizerState(), 2, kinds=kinds, tensor_within_host=True)
    mixed = _hosts(2, 3)
    assert mixed.device != P100 and mixed.device.figures == P100.figures
    prof = profiler(mixed, kind_types(host_types(mixed), "fp16"))
    assert prof.priced_as((2, 2, 1)) == (2, 2) and prof.priced_as((2, 2, 0)) == (2, 2, 0)
    untyped = prof(0, 2, (2, 2))
    solves = prof.solves
    assert prof(0, 2, (2, 2, 1)) == untyped and prof.solves == solves
    assert min(o.latency for o in prof(0, 2, (2, 2, 0))) < min(o.latency for o in untyped)
    # Equal figures, equal prices: the cost model reads nothing else of a device.
    p100s = Cluster("p100s", 4, 2, P100, mixed.intra_host, mixed.inter_host)
    assert profiler(p100s)(0, 2, (2, 2)) == untyped
