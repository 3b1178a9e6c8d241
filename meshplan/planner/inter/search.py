"""The two-level search (Alpa §5): operator clustering, stage costs from the intra-op ILP, the
stage–submesh DP, and the number of micro-batches around them; the result as a `Plan`.

For each micro-batch count B tried, the program traced at the micro-batch's size is clustered
into L layers (`clustering.py`), every layer range is priced on every submesh and logical shape
(`stage_costs.py`) and the DP picks the stages (`stage_dp.py`, Alpa eq. 2-5, 1F1B's in-flight
micro-batches in the memory check). With per-micro-batch latency t(b) = c + k·b for b samples,
eq. 2 gives T(B) = (S + B - 1)·(c + k·batch / B): more micro-batches shrink the bubble and the
activations kept until the fixed cost c of each dominates, so T is convex in B and the fastest
count is usually a large one for a large model. Counts are therefore tried from the most
micro-batches down, stopping at the first that is no faster (beyond Alpa, which takes B from the
user); counts whose micro-batches cannot fit by a memory floor (`_MemoryFloor`) are not
profiled. A pipeline of one stage is returned as that stage's own intra-op plan.

Alpa's ablations: "inter-only" plans each stage data parallel only (pipeline + data
parallelism); "equal-layer" cuts the layers into S equal stages on N/S devices each, for the
best S, instead of the DP's uneven stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from meshplan.cost.cluster import Cluster, cluster_to_dict
from meshplan.cost.mesh import logical_mesh
from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasiblePlanError, NoPipelineError
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan, StagePlan
from meshplan.planner.inter.clustering import cluster_layers, default_num_layers
from meshplan.planner.inter.placement import place_submeshes
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_problem import (ClusterShape, PipelineProblem,
                                                  PipelineSolution, Profile, gpipe,
                                                  one_f_one_b, pipeline_latency,
                                                  submesh_shapes)
from meshplan.planner.intra.choices import IntraOptions
from meshplan.planner.intra.to_plan import intra_plan

# Micro-batches each schedule keeps in flight on a stage (the DP's memory check). Both have the
# same latency (Alpa eq. 2); 1F1B keeps fewer, so "auto" is 1F1B.
SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def resolve_schedule(schedule: str) -> str:
    """The schedule a plan uses for ``schedule`` ("auto", "1f1b", "gpipe"); ValueError for an
    unknown one, NotImplementedError for interleaved 1F1B (not modelled yet)."""
    if schedule == "interleaved":
        raise NotImplementedError("the interleaved 1F1B schedule (virtual stages) is not "
                                  "implemented yet; use 'auto', '1f1b' or 'gpipe'")
    if schedule == "auto":
        return "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: auto, 1f1b, gpipe, "
                         "interleaved")
    return schedule


# (traced graph at one micro-batch's size, its fingerprint) for a micro-batch count.
GraphFor = Callable[[int], tuple[Graph, str]]


@dataclass(frozen=True)
class PipelineRequest:
    """What the search needs besides the program: the cluster and the training step."""

    cluster: Cluster
    options: IntraOptions
    optimizer: dict
    optimizer_bytes_per_param: float
    budget: float | None
    dtype: str
    num_layers: int | None = None
    name: str = "model"
    method: str = "auto"
    recompute: str = "auto"
    schedule: str = "1f1b"


@dataclass
class _Found:
    solution: PipelineSolution
    profiler: StageProfiler
    fingerprint: str
    unsupported: tuple[str, ...]


def search_pipeline(graph_for: GraphFor, counts: list[int], req: PipelineRequest) -> Plan:
    """The fastest pipeline over the micro-batch ``counts`` (module docstring). Raises
    InfeasiblePlanError when no count gives a plan that fits."""
    t0 = time.perf_counter()
    best: _Found | None = None
    errors: list[NoPipelineError] = []
    for b in sorted(counts, reverse=True):
        floor = _MemoryFloor.of(graph_for(b)[0], req)
        if not floor.may_fit():  # nor does any smaller count: its micro-batches are larger
            errors.append(NoPipelineError("below the memory floor", req.budget,
                                          floor.per_device))
            break
        try:
            found = _search_one(graph_for, b, req)
        except NoPipelineError as e:
            errors.append(e)
            continue
        if best is not None and found.solution.total_latency >= best.solution.total_latency:
            break  # eq. 2 is convex in B: past the fastest count it only grows
        best = found
    if best is None:
        raise _infeasible(errors, counts, req)
    return _to_plan(best, req, time.perf_counter() - t0)


@dataclass(frozen=True)
class _MemoryFloor:
    """A lower bound of any plan's memory, to skip micro-batch counts without profiling them:
    summed over all devices, a plan holds every parameter's state once and, for at least one
    micro-batch, every activation once (sharding never shrinks the total; a recomputed stage
    still materializes its activations in backward)."""

    per_device: float
    budget: float | None

    @staticmethod
    def of(traced: Graph, req: PipelineRequest) -> "_MemoryFloor":
        graph = with_compute_dtype(traced, req.dtype)
        state = sum(n.out.numel for n in graph.nodes if n.role == "param") * (
            8.0 + req.optimizer_bytes_per_param)
        act = sum(n.out.nbytes for n in graph.nodes if n.role in ("input", "target") or (
            n.role == "op" and n.requires_grad))
        return _MemoryFloor((state + act) / req.cluster.num_devices, req.budget)

    def may_fit(self) -> bool:
        return self.budget is None or self.per_device <= self.budget


def _infeasible(errors: list[NoPipelineError], counts: list[int], req: PipelineRequest
                ) -> InfeasiblePlanError:
    need = min(e.min_memory_bytes for e in errors)
    assert req.budget is not None, "without a budget some pipeline always fits"
    return InfeasiblePlanError(
        req.budget, need,
        f"Searched pipelines of up to {req.cluster.num_devices} stages with "
        f"{counts[0]}-{counts[-1]} micro-batches, recomputation and ZeRO; use more devices, "
        "a smaller global batch or a larger budget.")


def _search_one(graph_for: GraphFor, b: int, req: PipelineRequest) -> _Found:
    traced, fingerprint = graph_for(b)
    graph = with_compute_dtype(traced, req.dtype)
    cl = req.cluster
    num_layers = req.num_layers or default_num_layers(graph, cl.num_devices)
    layering = cluster_layers(graph, num_layers)
    profiler = StageProfiler(graph, layering, cl, req.options, req.optimizer_bytes_per_param, b,
                             req.budget, req.recompute)
    shape = ClusterShape(cl.num_hosts, cl.devices_per_host)
    profiler.prefetch(submesh_shapes(shape))
    profiles = [profiler] if req.method != "equal-layer" else \
        [_equal_layers(profiler, num_layers, n, shape) for n in _stage_counts(num_layers, shape)]
    best, errors = None, []
    for profile in profiles:
        problem = PipelineProblem(shape, num_layers, profile, b, device_memory=req.budget,
                                  in_flight=SCHEDULES[req.schedule])
        try:
            sol = solve_stage_dp(problem)
        except NoPipelineError as e:
            errors.append(e)
            continue
        if best is None or sol.total_latency < best.total_latency:
            best = sol
    if best is None:
        raise min(errors, key=lambda e: e.min_memory_bytes)
    return _Found(best, profiler, fingerprint, traced.unsupported_ops)


def _stage_counts(num_layers: int, shape: ClusterShape) -> list[int]:
    """Stage counts S for Alpa's equal-layer ablation: S divides the layers, and N/S devices
    form one of the submesh shapes."""
    sizes = {h * d for h, d in submesh_shapes(shape)}
    return [n for n in range(1, num_layers + 1) if num_layers % n == 0
            and shape.num_devices % n == 0 and shape.num_devices // n in sizes]


def _equal_layers(profile: StageProfiler, num_layers: int, num_stages: int,
                  shape: ClusterShape) -> Profile:
    """``profile`` restricted to S stages of L/S layers on N/S devices each (Alpa's
    "equal layer" ablation: no DP over uneven stages; each stage's intra plan still searched)."""
    per, devices = num_layers // num_stages, shape.num_devices // num_stages

    def restricted(start: int, end: int, submesh: tuple[int, int]) -> tuple:
        if end - start != per or start % per or submesh[0] * submesh[1] != devices:
            return ()
        return profile(start, end, submesh)
    return restricted


def _to_plan(found: _Found, req: PipelineRequest, seconds: float) -> Plan:
    cl, sol, prof = req.cluster, found.solution, found.profiler
    devices = place_submeshes([s.submesh for s in sol.stages], cl.num_hosts,
                              cl.devices_per_host)
    stages = []
    solved_all = prof.solutions([(s.start, s.end, s.submesh, s.option.label, s.in_flight)
                                 for s in sol.stages])
    for i, (s, devs, solved) in enumerate(zip(sol.stages, devices, solved_all)):
        label = s.option.label
        form = replace(solved.form, ctx=replace(solved.form.ctx, recompute=label.recompute))
        sub = replace(cl, name=f"{cl.name}[stage {i}]", num_hosts=s.submesh[0],
                      devices_per_host=s.submesh[1])
        plan = intra_plan(form, solved.solution, logical_mesh(sub, label.logical_shape), sub,
                          name=f"{req.name}[stage {i}]", fingerprint=solved.graph.fingerprint(),
                          method=req.method, optimizer=req.optimizer, options=req.options,
                          budget=req.budget, search_time_s=0.0, dtype=req.dtype,
                          unsupported_ops=found.unsupported)
        stages.append(StagePlan(i, (s.start, s.end), devs, s.submesh, label.logical_shape,
                                label.recompute, s.in_flight, solved.latency,
                                solved.memory_bytes, plan))
    # The stages solved whole: their own latencies give the step time (eq. 2), not the DP's
    # estimates by parts.
    step = pipeline_latency(tuple(s.latency_s for s in stages), prof.microbatches)
    stats = {"stage_solves": prof.solves, "tmax_tried": sol.stats.num_tmax_tried,
             "profile_calls": sol.stats.num_profile_calls, "dp_seconds": sol.stats.seconds}
    if len(stages) == 1:
        only = stages[0].plan
        assert only is not None
        return replace(only, model=req.name, graph_fingerprint=found.fingerprint,
                       cluster=cluster_to_dict(cl),
                       search_time_s=seconds, ilp=only.ilp | stats,
                       stages=(replace(stages[0], plan=None),),
                       num_layers=prof.layering.num_layers)
    mesh = logical_mesh(cl)
    return Plan(model=req.name, graph_fingerprint=found.fingerprint,
                mesh_shape=tuple(mesh.shape), alpha=tuple(mesh.alpha), beta=tuple(mesh.beta),
                cluster=cluster_to_dict(cl), method=req.method, optimizer=req.optimizer,
                ops=(), params=(), sources=(), collectives=(),
                objective=step, objective_units="seconds",
                search_time_s=seconds, ilp=stats,
                predicted={"step_time_s": step,
                           "peak_memory_bytes": max(s.memory_bytes for s in stages)},
                dtype=req.dtype, microbatches=prof.microbatches,
                recompute=any(s.recompute for s in stages), stages=tuple(stages),
                schedule=req.schedule, num_layers=prof.layering.num_layers,
                options={"memory_budget_bytes": req.budget,
                         "unsupported_ops": list(found.unsupported)})
