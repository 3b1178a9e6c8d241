"""The stage–submesh DP (Alpa §5.2) against brute force; its pruning, epsilon bound, inputs."""

from __future__ import annotations

import ast
import dataclasses
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshplan.errors import NoPipelineError
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_dp_reference import brute_force
from meshplan.planner.inter.stage_problem import (
    ClusterShape,
    InFlight,
    Links,
    PipelineProblem,
    PipelineSolution,
    StageOption,
    gpipe,
    inside_host,
    one_f_one_b,
    pipeline_latency,
    placeable,
    profile_from_table,
    submesh_shapes,
)

# (1, H, True): the host-granular view of H hosts, stages of any divisor of H hosts too.
CLUSTERS = ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (1, 6), (3, 2),
            (1, 6, True), (1, 12, True))


def random_problem(seed: int, max_layers: int = 6) -> PipelineProblem:
    """A small random problem: 0-3 options per triple, latencies with ties, memory that binds."""
    rng = random.Random(seed)
    cluster = ClusterShape(*rng.choice(CLUSTERS))
    num_layers = rng.randint(1, max_layers)
    table = {}
    for start in range(num_layers):
        for end in range(start + 1, num_layers + 1):
            for mesh in submesh_shapes(cluster):
                table[(start, end, mesh)] = tuple(
                    StageOption(rng.choice((rng.random(), round(rng.random(), 1))),
                                rng.randint(0, 10), rng.randint(0, 5), label=j)
                    for j in range(rng.choice((0, 1, 1, 2, 2, 3))))
    return PipelineProblem(cluster, num_layers, profile_from_table(table),
                           num_microbatches=rng.choice((1, 2, 4, 8)),
                           device_memory=rng.choice((None, 8, 12, 20, 40)),
                           in_flight=rng.choice((one_f_one_b, gpipe)))


Solver = Callable[..., PipelineSolution]


def solve_or_none(solve: Solver, problem: PipelineProblem, **kwargs: object
                  ) -> PipelineSolution | None:
    try:
        return solve(problem, **kwargs)
    except NoPipelineError:
        return None


def assert_valid(problem: PipelineProblem, solution: PipelineSolution) -> None:
    """Contiguous stages over all layers, every device once, profiled options that fit."""
    stages, b = solution.stages, problem.num_microbatches
    assert stages[0].start == 0 and stages[-1].end == problem.num_layers
    assert all(x.end == y.start for x, y in zip(stages, stages[1:]))
    assert all(s.start < s.end for s in stages)
    assert sum(s.num_devices for s in stages) == problem.cluster.num_devices
    for index, stage in enumerate(stages):
        assert stage.submesh in submesh_shapes(problem.cluster)
        assert stage.option in problem.profile(stage.start, stage.end, stage.submesh)
        assert stage.in_flight == problem.in_flight(index, len(stages), b)
        assert problem.fits(stage.option, stage.in_flight)
    latencies = tuple(s.option.latency for s in stages)
    assert solution.total_latency == pipeline_latency(latencies, b)
    assert solution.t_max == max(latencies)


def test_dp_equals_brute_force_on_random_cases() -> None:
    infeasible = memory_bound = 0
    for seed in range(260):
        problem = random_problem(seed)
        want, got = solve_or_none(brute_force, problem), solve_or_none(solve_stage_dp, problem)
        assert (want is None) == (got is None), seed
        if want is None:
            infeasible += 1
            continue
        assert_valid(problem, got)
        assert got.total_latency == pytest.approx(want.total_latency, rel=1e-9, abs=1e-12), seed
        unlimited = solve_stage_dp(PipelineProblem(
            problem.cluster, problem.num_layers, problem.profile, problem.num_microbatches,
            None, problem.in_flight))
        memory_bound += unlimited.total_latency < got.total_latency
    assert infeasible >= 20 and memory_bound >= 20, (infeasible, memory_bound)


def with_links(problem: PipelineProblem, seed: int) -> PipelineProblem:
    """``problem`` with its boundaries priced by link (`Links`): a stage inside a host saves a
    random part of its fastest option's latency (what a transfer priced across hosts would
    save; never more than the latency)."""
    rng = random.Random(seed)
    shapes = submesh_shapes(problem.cluster)
    share = {(k, m): rng.choice((0.0, rng.random(), 0.5)) for k in range(problem.num_layers)
             for m in shapes}

    def discount(start: int, mesh: tuple[int, ...]) -> float:
        fastest = min((o.latency for end in range(start + 1, problem.num_layers + 1)
                       for o in problem.profile(start, end, mesh)), default=0.0)
        return share[(start, mesh)] * fastest
    return dataclasses.replace(problem, links=Links(discount))


def assert_linked(problem: PipelineProblem, solution: PipelineSolution) -> None:
    """`assert_valid` for a problem with links: stages on contiguous positions in order, each
    inside a host at its option's latency less its discount."""
    per_host, offset = problem.cluster.devices_per_host, 0
    plain = []
    for index, stage in enumerate(solution.stages):
        assert placeable(stage.submesh, offset, per_host), (stage, offset)
        option = stage.option
        if index and inside_host(offset, per_host):
            option = dataclasses.replace(option, latency=option.latency + problem.links.discount(
                stage.start, stage.submesh))
            assert option.latency == pytest.approx(next(
                o.latency for o in problem.profile(stage.start, stage.end, stage.submesh)
                if o.label == option.label), rel=1e-12)
            option = next(o for o in problem.profile(stage.start, stage.end, stage.submesh)
                          if o.label == option.label)
        plain.append(dataclasses.replace(stage, option=option))
        offset += stage.num_devices
    assert_valid(dataclasses.replace(problem, links=None),
                 dataclasses.replace(solution, stages=tuple(plain),
                                     total_latency=pipeline_latency(
                                         tuple(s.option.latency for s in plain),
                                         problem.num_microbatches),
                                     t_max=max(s.option.latency for s in plain)))
    latencies = tuple(s.option.latency for s in solution.stages)
    assert solution.total_latency == pipeline_latency(latencies, problem.num_microbatches)


def test_dp_with_links_equals_brute_force_on_random_cases() -> None:
    """Stages laid on contiguous positions in order, a boundary inside a host cheaper than one
    across hosts: the DP (placeable shapes only, discounted where the boundary is inside a
    host) is exact, in every search order."""
    discounted = 0
    for seed in range(300):
        problem = with_links(random_problem(seed), seed)
        want = solve_or_none(brute_force, problem)
        for search in ("bisect", "scan", "all"):
            got = solve_or_none(solve_stage_dp, problem, search=search)
            assert (want is None) == (got is None), (seed, search)
            if want is None:
                continue
            assert_linked(problem, got)
            assert got.total_latency == pytest.approx(want.total_latency, rel=1e-9,
                                                      abs=1e-12), (seed, search)
        if want is not None:
            plain = solve_or_none(solve_stage_dp, dataclasses.replace(problem, links=None))
            discounted += plain is not None and want.total_latency < plain.total_latency
    assert discounted >= 30, discounted


@pytest.mark.parametrize("max_layers", [6, 10])
def test_search_orders_agree_with_every_candidate(max_layers: int) -> None:
    for seed in range(1000, 1060):
        problem = random_problem(seed, max_layers)
        every = solve_or_none(solve_stage_dp, problem, search="all")
        for search in ("bisect", "scan"):
            got = solve_or_none(solve_stage_dp, problem, search=search)
            assert (got is None) == (every is None), (seed, search)
            if got is not None:
                assert_valid(problem, got)
                assert got.total_latency == pytest.approx(every.total_latency, rel=1e-12)
                assert got.stats.num_tmax_tried <= every.stats.num_tmax_tried + 1


@pytest.mark.parametrize("epsilon", [0.05, 0.5])
def test_epsilon_is_within_one_plus_epsilon(epsilon: float) -> None:
    """Bound: T_eps <= (1 + eps) T*: the optimum's t* is covered by a DP run at
    u <= (1 + eps) t* (scan), or its interval is dropped only once best <= (1 + eps) * its lower
    bound (bisect)."""
    for seed in range(2000, 2080):
        problem = random_problem(seed, 8)
        exact = solve_or_none(solve_stage_dp, problem)
        for search in ("bisect", "scan"):
            got = solve_or_none(solve_stage_dp, problem, epsilon=epsilon, search=search)
            assert (got is None) == (exact is None)
            if got is not None:
                assert_valid(problem, got)
                assert exact.total_latency * (1 - 1e-12) <= got.total_latency
                assert got.total_latency <= (1 + epsilon) * exact.total_latency * (1 + 1e-12)


def two_layer_problem(memory: float, in_flight: InFlight = one_f_one_b) -> PipelineProblem:
    """Two layers on (1, 2): one layer per device (t = 1, 1 byte of activations per micro-batch)
    or both layers on both devices (t = 3)."""
    table = {(0, 1, (1, 1)): (StageOption(1.0, 0, 1),), (1, 2, (1, 1)): (StageOption(1.0, 0, 1),),
             (0, 2, (1, 2)): (StageOption(3.0, 0, 1, label="whole"),)}
    return PipelineProblem(ClusterShape(1, 2), 2, profile_from_table(table), 4, memory, in_flight)


def test_host_granular_stages_of_any_divisor_of_the_hosts() -> None:
    """Six hosts, two equal layers, a stage's latency its layers' work over its hosts plus a
    cost growing with them (its gradient exchange): only stages of three hosts split the work
    evenly (what 64 stages of 6 hosts are to Megatron-LM's 1T on 384); powers of two alone give
    the slower 2 + 4 hosts, or one stage over all six."""
    def profile(start: int, end: int, mesh: tuple) -> tuple:
        return (StageOption(6.0 * (end - start) / mesh[1] + 0.5 * mesh[1], 0, 0),)

    def solve(divisors: bool) -> PipelineSolution:
        return solve_stage_dp(PipelineProblem(ClusterShape(1, 6, divisor_widths=divisors), 2,
                                              profile, 8, None, one_f_one_b))

    even = solve(True)
    assert [s.submesh for s in even.stages] == [(1, 3), (1, 3)]
    assert even.total_latency < solve(False).total_latency


def test_first_stage_holds_more_micro_batches_under_1f1b() -> None:
    two = solve_stage_dp(two_layer_problem(2.0))  # stage 0 keeps min(2, 4) = 2 micro-batches
    assert [s.in_flight for s in two.stages] == [2, 1]
    assert two.total_latency == 2 + 3 * 1
    one = solve_stage_dp(two_layer_problem(1.5))  # 2 do not fit: a single stage
    assert [(s.submesh, s.option.label, s.in_flight) for s in one.stages] == [((1, 2), "whole", 1)]
    assert one.total_latency == 3 + 3 * 3
    with pytest.raises(NoPipelineError) as err:  # GPipe keeps all 4 in flight
        solve_stage_dp(two_layer_problem(3.0, gpipe))
    assert err.value.min_memory_bytes == 4


def test_no_pipeline_error_says_what_memory_would_do() -> None:
    for seed in range(3000, 3150):
        problem = random_problem(seed)
        if problem.device_memory is None or solve_or_none(solve_stage_dp, problem) is not None:
            continue
        with pytest.raises(NoPipelineError) as err:
            solve_stage_dp(problem)
        need = err.value.min_memory_bytes
        assert err.value.device_memory == problem.device_memory
        if not math.isfinite(need):
            assert "profiled option for every stage" in str(err.value)
            continue
        assert need > problem.device_memory and str(need) in str(err.value)
        for memory, feasible in ((need, True), (need * (1 - 1e-9), False)):
            relaxed = PipelineProblem(problem.cluster, problem.num_layers, problem.profile,
                                      problem.num_microbatches, memory, problem.in_flight)
            assert (solve_or_none(brute_force, relaxed) is not None) == feasible


def test_empty_profile_raises() -> None:
    problem = PipelineProblem(ClusterShape(1, 2), 3, lambda start, end, mesh: ())
    with pytest.raises(NoPipelineError, match="profiled option for every stage"):
        solve_stage_dp(problem)


def test_schedules_and_submesh_shapes() -> None:
    assert [one_f_one_b(i, 4, 3) for i in range(4)] == [3, 3, 2, 1]
    assert [gpipe(i, 4, 3) for i in range(4)] == [3, 3, 3, 3]
    assert submesh_shapes(ClusterShape(2, 8)) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert submesh_shapes(ClusterShape(1, 6)) == ((1, 1), (1, 2), (1, 4), (1, 6))
    assert submesh_shapes(ClusterShape(3, 1)) == ((1, 1), (2, 1), (3, 1))
    assert len(submesh_shapes(ClusterShape(16, 8))) == 19


def test_profile_asked_once_per_triple() -> None:
    calls = []

    def profile(start: int, end: int, mesh: tuple[int, int]) -> tuple[StageOption, ...]:
        calls.append((start, end, mesh))
        return (StageOption(float(end - start) / (mesh[0] * mesh[1])),)

    solution = solve_stage_dp(PipelineProblem(ClusterShape(2, 4), 5, profile, 4))
    assert len(calls) == len(set(calls)) == 15 * 4 == solution.stats.num_profile_calls


@pytest.mark.parametrize("make, match", [
    (lambda: ClusterShape(0, 8), "num_hosts"),
    (lambda: ClusterShape(2, -1), "devices_per_host"),
    (lambda: PipelineProblem(ClusterShape(1, 1), 0, lambda *a: ()), "num_layers"),
    (lambda: PipelineProblem(ClusterShape(1, 1), 1, lambda *a: (), 0), "num_microbatches"),
    (lambda: PipelineProblem(ClusterShape(1, 1), 1, lambda *a: (), 1, -5.0), "device_memory"),
    (lambda: StageOption(-1.0), "latency"),
    (lambda: StageOption(1.0, math.nan), "state_bytes"),
    (lambda: solve_stage_dp(two_layer_problem(9), epsilon=-0.1), "epsilon"),
    (lambda: solve_stage_dp(two_layer_problem(9), epsilon=math.inf), "epsilon"),
    (lambda: solve_stage_dp(two_layer_problem(9), search="greedy"), "greedy"),
    (lambda: solve_stage_dp(two_layer_problem(9, lambda i, s, b: i + 1)), "stages from the end"),
])
def test_bad_inputs_raise_value_error_naming_them(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_malformed_profile_raises_type_error() -> None:
    problem = PipelineProblem(ClusterShape(1, 1), 1, lambda *a: [1.0])
    with pytest.raises(TypeError, match="StageOption"):
        solve_stage_dp(problem)


def test_no_torch_and_no_graphs() -> None:
    folder = Path(__file__).parent.parent / "meshplan" / "planner" / "inter"
    for name in ("stage_problem.py", "stage_tables.py", "stage_dp.py", "stage_dp_reference.py"):
        tree = ast.parse((folder / name).read_text())
        modules = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for a in node.names} | {node.module for node in ast.walk(tree)
                                           if isinstance(node, ast.ImportFrom)}
        assert not {m for m in modules if m and m.split(".")[0] == "torch"}, name
        assert not {m for m in modules if m and ("ir" in m.split(".") or "intra" in m)}, name


def uniform_random_problem(memory: float | None, seed: int = 0) -> PipelineProblem:
    """L = 48 on 16 x 8 (19 submeshes), 2 options per triple with uniform random latencies."""
    rng = np.random.default_rng(seed)
    cluster = ClusterShape(16, 8)
    index = {mesh: j for j, mesh in enumerate(submesh_shapes(cluster))}
    draws = rng.uniform(0, 1, (3, 48, 49, len(index), 2))  # latency, state, activation
    draws[2] *= 0.2

    def profile(start: int, end: int, mesh: tuple[int, int]) -> tuple[StageOption, ...]:
        lat, state, act = draws[:, start, end, index[mesh]]
        return tuple(StageOption(float(lat[o]), float(state[o]), float(act[o]), o)
                     for o in range(2))
    return PipelineProblem(cluster, 48, profile, 8, memory)


def layered_problem(memory: float | None, seed: int = 0) -> PipelineProblem:
    """L = 48 on 16 x 8: latency ~ work / devices, slower across hosts; a recompute option."""
    rng = np.random.default_rng(seed)
    cluster = ClusterShape(16, 8)
    index = {mesh: j for j, mesh in enumerate(submesh_shapes(cluster))}
    work, params = (np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 1.5, 48))])
                    for _ in range(2))
    noise = rng.uniform(0.8, 1.25, (48, 49, len(index), 2))

    def profile(start: int, end: int, mesh: tuple[int, int]) -> tuple[StageOption, ...]:
        hosts, devices = mesh
        base = ((work[end] - work[start]) / (hosts * devices) * (1 + 0.1 * math.log2(devices))
                * (1 + 0.5 * (hosts - 1)) * 1e-3 + 2e-5) * noise[start, end, index[mesh]]
        state = (params[end] - params[start]) * 16e9 / (hosts * devices)
        act = (end - start) * 1e9 / (hosts * devices)
        return (StageOption(float(base[0]), float(state), float(act), "plain"),
                StageOption(float(base[1] * 1.3), float(state), float(act * 0.2), "recompute"))
    return PipelineProblem(cluster, 48, profile, 8, memory)


@pytest.mark.parametrize("make, memory", [(uniform_random_problem, None),
                                          (uniform_random_problem, 1.5),
                                          (layered_problem, 10e9)])
def test_speed_48_layers_on_16x8(make: Callable[[float | None], PipelineProblem],
                                 memory: float | None) -> None:
    problem = make(memory)
    began = time.perf_counter()
    solution = solve_stage_dp(problem)
    seconds = time.perf_counter() - began
    print(f"\n{make.__name__}(memory={memory}): {seconds:.2f} s, {solution.stats}, "
          f"{len(solution.stages)} stages, T = {solution.total_latency:.6g}")
    assert_valid(problem, solution)
    assert seconds < 20


def test_best_fitting_option_of_every_count_at_once_is_each_counts_own() -> None:
    """`stage_tables._best_fitting` answers all in-flight counts in one pass: per count and
    triple, the fastest option whose state + activations x count fits, as filtering the options
    count by count finds it (ties in latency keep the first listed; needs exactly at the
    budget fit; options that fit no count, or every count)."""
    from meshplan.planner.inter.stage_tables import _best_fitting
    rng = np.random.default_rng(7)
    shape, n = (3, 4, 2), 4000
    flat = {"latency": rng.choice([0.5, 1.0, 1.5, 2.0, np.inf], n) * rng.integers(1, 4, n),
            "state": rng.integers(0, 12, n).astype(np.float64),
            "activation": rng.choice([0.0, 0.5, 1.0, 3.0], n),
            "triple": rng.integers(0, math.prod(shape), n),
            "position": rng.integers(0, 9, n)}
    order = np.lexsort((flat["latency"], flat["triple"]))
    counts = [1, 2, 3, 3, 5, 8, 13]
    for memory in (None, 0.0, 7.0, 12.5, 100.0):
        got = _best_fitting(flat, order, counts, memory, shape)
        assert sorted(got) == sorted(set(counts))
        for c in set(counts):
            latency, choice = np.full(shape, np.inf), np.full(shape, -1)
            for o in order[::-1]:   # the first fitting one in order writes last
                if memory is None or flat["state"][o] + flat["activation"][o] * c <= memory:
                    latency.flat[flat["triple"][o]] = flat["latency"][o]
                    choice.flat[flat["triple"][o]] = flat["position"][o]
            assert np.array_equal(got[c][0], latency) and np.array_equal(got[c][1], choice)
