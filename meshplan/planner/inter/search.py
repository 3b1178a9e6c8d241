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

Scale. On up to `HOST_GRANULAR_ABOVE` hosts (Alpa's testbed has 8) the submeshes are Alpa's:
(1, 2^k) within a host and (k, M) for every k, each with every logical shape. Beyond that the
search is host-granular: stages take whole hosts, (k, M) for k a power of two or the whole
cluster, with the tensor axis of their logical mesh inside a host (Alpa's own default logical
space; Megatron-LM finds tensor parallelism across hosts slow). A stage of 1536 GPUs has 30
logical shapes and a cluster of 192 hosts 191 (k, M) shapes; pricing each is what would not
scale, while a pipeline over hundreds of GPUs gains nothing from stages of a few.

Alpa's ablations: "inter-only" plans each stage data parallel only (pipeline + data
parallelism); "equal-layer" cuts the layers into S equal stages on N/S devices each, for the
best S, instead of the DP's uneven stages; "equal-operator" clusters layers of equal op counts
instead of eq. 6 (`clustering.py`), then runs the same DP. Hand-style pipelines (Megatron-LM's
dp x tp x pp) are priced in `manual.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from meshplan.cost.cluster import Cluster
from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasiblePlanError, NoPipelineError
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan
from meshplan.planner.inter.clustering import cluster_layers, default_num_layers
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_problem import (ClusterShape, PipelineProblem, Profile,
                                                  gpipe, one_f_one_b, submesh_shapes)
# The result of a search and its Plan, shared with the hand-style pipelines (`manual.py`).
from meshplan.planner.inter.to_plan import FoundPipeline as _Found
from meshplan.planner.inter.to_plan import pipeline_plan as _to_plan
from meshplan.planner.intra.choices import IntraOptions

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


# Clusters of more hosts are planned host-granular (module docstring).
HOST_GRANULAR_ABOVE = 8

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
    progress: bool = False   # progress bars on stderr (when it is a terminal)


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
    layering = cluster_layers(graph, num_layers,
                              balance="ops" if req.method == "equal-operator" else "flops")
    by_hosts = cl.num_hosts > HOST_GRANULAR_ABOVE
    profiler = StageProfiler(graph, layering, cl, req.options, req.optimizer_bytes_per_param, b,
                             req.budget, req.recompute, show_progress=req.progress,
                             tensor_within_host=by_hosts)
    # The DP's view of the cluster: its devices, or in host-granular mode its hosts (a
    # "device" of the DP is a whole host; submesh (1, k) of it is (k, M) of the cluster).
    shape = ClusterShape(1, cl.num_hosts) if by_hosts else \
        ClusterShape(cl.num_hosts, cl.devices_per_host)
    real = (lambda sub: (sub[1], cl.devices_per_host)) if by_hosts else (lambda sub: sub)
    profiler.prefetch(tuple(real(sub) for sub in submesh_shapes(shape)))
    whole: Profile = (lambda start, end, sub: profiler(start, end, real(sub)))
    profiles = [whole] if req.method != "equal-layer" else \
        [_equal_layers(whole, num_layers, n, shape) for n in _stage_counts(num_layers, shape)]
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
    best = replace(best, stages=tuple(replace(s, submesh=real(s.submesh)) for s in best.stages))
    return _Found(best, profiler, fingerprint, traced.unsupported_ops)


def _stage_counts(num_layers: int, shape: ClusterShape) -> list[int]:
    """Stage counts S for Alpa's equal-layer ablation: S divides the layers, and N/S devices
    form one of the submesh shapes."""
    sizes = {h * d for h, d in submesh_shapes(shape)}
    return [n for n in range(1, num_layers + 1) if num_layers % n == 0
            and shape.num_devices % n == 0 and shape.num_devices // n in sizes]


def _equal_layers(profile: Profile, num_layers: int, num_stages: int,
                  shape: ClusterShape) -> Profile:
    """``profile`` restricted to S stages of L/S layers on N/S devices each (Alpa's
    "equal layer" ablation: no DP over uneven stages; each stage's intra plan still searched)."""
    per, devices = num_layers // num_stages, shape.num_devices // num_stages

    def restricted(start: int, end: int, submesh: tuple[int, int]) -> tuple:
        if end - start != per or start % per or submesh[0] * submesh[1] != devices:
            return ()
        return profile(start, end, submesh)
    return restricted
