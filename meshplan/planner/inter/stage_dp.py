"""Alpa's stage–submesh dynamic program (Alpa §5.2, eq. 2–5) over abstract per-stage costs.

Problem. Split layers ``0..L-1`` into contiguous stages ``[l_1, r_1), ..., [l_S, r_S)``, give
stage ``j`` a submesh of ``n_j`` devices (shapes from `submesh_shapes`) with
``sum_j n_j = N * M``, and an option whose memory fits (eq. 5, `PipelineProblem.fits`), to
minimize (eq. 2)::

    T = sum_j t_j + (B - 1) * max_j t_j

Method (Alpa's). For each candidate ``t_max`` (distinct latencies of usable options), minimize
``G(t_max) = sum_j t_j`` subject to ``t_j <= t_max`` with the backward DP of eq. 3
(`stage_tables.sweep`, over buckets of stages left ``r``, first layer ``k`` and devices ``d``);
then ``T* = min_{t_max} G(t_max) + (B - 1) * t_max`` (eq. 4). The true optimum's slowest stage is
itself a candidate, so the enumeration is exact.

Searches over the sorted candidates ``c_0 < ... < c_{n-1}`` (``search=``); each DP run also
backtracks its pipeline, whose true T updates the best. All three are exact at ``epsilon = 0``
(up to a 1e-12 relative slack in the stop tests):

- "scan" (Alpa's early pruning): increasing order, stop at the first ``c`` with
  ``(B - 1) c + G(inf) >= best T``, since ``G >= G(inf)``. With ``epsilon > 0`` the DP runs at
  ``u = (1 + epsilon) c`` for the smallest candidate ``c`` not yet covered, covering ``[c, u]``;
  the optimum's ``t*`` lies in such a ``[c, u]``, so ``T <= G(t*) + (B - 1) u <= (1 + epsilon) T*``.
  (Alpa skips to candidates at least epsilon above the last one; running at ``u`` instead keeps
  the skipped candidates covered, which gives the bound.)
- "bisect" (default; `_search_bisect`): the same bound on intervals of candidates, using that
  ``G`` is non-increasing: every ``t`` in ``[c_a, c_b)`` has ``T >= (B - 1) c_a + G(c_b)``.
  Best-first branch and bound; an interval is dropped once ``best <= (1 + epsilon) * bound``,
  so again ``T <= (1 + epsilon) T*``. On 48 layers x 16x8 it runs ~20 DPs where "scan" ran
  thousands.
- "all": every candidate, no pruning (a check of the other two).

Links (`Links`). Stages on contiguous positions in order: a shape is allowed only where it
can be laid from position N - d (``d`` devices left), and a stage whose inbound boundary is
inside a host costs its latency less its discount; the discounted latencies are candidates
too, so the enumeration stays exact.

Restriction. The DP knows a stage's distance from the end, not its index, so ``in_flight(i, S,
B)`` must depend on ``S - i`` and ``B`` only (1F1B and GPipe do; checked on entry).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from meshplan.errors import NoPipelineError
from meshplan.planner.inter.stage_problem import (
    ClusterShape,
    DpStats,
    PipelineProblem,
    PipelineSolution,
    StageOption,
    StagePlacement,
    gpipe,
    inside_host,
    make_solution,
    one_f_one_b,
    pipeline_latency,
    profile_from_table,
)
from meshplan.planner.inter.stage_tables import (
    StageTables,
    backtrack,
    build_tables,
    memory_need,
    sweep,
)

__all__ = ["SEARCHES", "ClusterShape", "NoPipelineError", "PipelineProblem", "PipelineSolution",
           "StageOption", "StagePlacement", "gpipe", "one_f_one_b", "profile_from_table",
           "solve_stage_dp"]

# Stop tests compare float sums taken in different orders; allow that much rounding.
_REL_TOL = 1e-12

SEARCHES = ("bisect", "scan", "all")


@dataclass
class _Search:
    """The search's working state (private): tables, candidates and the best pipeline so far."""

    problem: PipelineProblem
    tables: StageTables
    candidates: np.ndarray  # distinct usable latencies, increasing
    # With links: every latency less its inbound discount inside a host.
    discounted: np.ndarray | None = None
    total: float = math.inf
    stages: tuple[StagePlacement, ...] = ()
    num_tried: int = 0

    def lower_bound_beaten(self, lower_bound: float, epsilon: float) -> bool:
        """Whether every pipeline with T >= ``lower_bound`` is within ``1 + epsilon`` of best."""
        return self.total <= (1 + epsilon) * lower_bound * (1 + _REL_TOL)


def solve_stage_dp(problem: PipelineProblem, *, epsilon: float = 0.0,
                   search: str = "bisect") -> PipelineSolution:
    """The pipeline minimizing eq. 2 (exact when ``epsilon == 0``, else within ``1 + epsilon``).

    ``search`` orders the t_max candidates: "bisect" (default) bounds intervals of candidates,
    "scan" is Alpa's increasing scan with early stop, "all" evaluates every candidate (slow; a
    check of the other two). Raises ValueError for a bad ``epsilon``, ``search`` or
    ``in_flight``, TypeError for a malformed profile, NoPipelineError when nothing is feasible.
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (
            math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    began = time.perf_counter()
    tables = build_tables(problem)
    finite = tables.latency[np.isfinite(tables.latency)]
    if finite.size == 0:
        raise _no_pipeline(problem, tables)
    discounted = None
    if tables.discount is not None:
        # A stage inside a host may be the slowest at its discounted latency.
        discounted = tables.latency - tables.discount[None, :, None, :]
        finite = np.concatenate([finite, discounted[np.isfinite(discounted)]])
    state = _Search(problem, tables, np.unique(finite), discounted)
    {"bisect": _search_bisect, "scan": _search_scan, "all": _search_all}[search](
        state, float(epsilon))
    if not state.stages:
        raise _no_pipeline(problem, tables)
    stats = DpStats(state.num_tried, len(tables.options), time.perf_counter() - began)
    return make_solution(state.stages, problem.num_microbatches, stats)


def _search_all(state: _Search, epsilon: float) -> None:
    """Evaluate every candidate (epsilon unused)."""
    for c in state.candidates:
        _evaluate(state, float(c))


def _search_scan(state: _Search, epsilon: float) -> None:
    """Alpa's scan: candidates in increasing order, stop once ``(B-1) c + G(inf)`` >= best.

    With ``epsilon > 0`` each DP runs at ``u = (1 + epsilon) c``, covering candidates up to u.
    """
    b, candidates = state.problem.num_microbatches, state.candidates
    g_inf, _ = _evaluate(state, float(candidates[-1]))
    index = 0
    while math.isfinite(g_inf) and index < len(candidates):
        c = float(candidates[index])
        if state.lower_bound_beaten((b - 1) * c + g_inf, 0.0):
            break  # every pipeline not yet covered has t_max >= c
        u = c * (1 + epsilon)
        _evaluate(state, u)
        index = int(np.searchsorted(candidates, u, side="right"))


def _search_bisect(state: _Search, epsilon: float) -> None:
    """Branch and bound over index intervals of the candidates, best lower bound first.

    An interval ``[a, b)`` of unevaluated candidates comes with ``G(c_b)``, known; since ``G`` is
    non-increasing, every pipeline with t_max in it has ``T >= (B-1) c_a + G(c_b)``. Evaluating
    the middle ``c_x`` gives ``G(c_x)`` and a pipeline whose slowest stage is ``c_j <= c_x``, so
    ``G = G(c_x)`` on ``[c_j, c_x]`` (those candidates are no better than that pipeline): split
    into ``[a, j)`` and ``[x+1, b)``, the latter only if ``G(c_x) > G(c_b)`` (else ``G`` is flat
    there and ``T`` grows). An infeasible ``c_x`` discards ``[a, x]``.
    """
    b, candidates = state.problem.num_microbatches, state.candidates
    heap: list[tuple[float, int, int, float]] = []

    def push(lo: int, hi: int, g_hi: float) -> None:
        if lo < hi:
            heapq.heappush(heap, ((b - 1) * float(candidates[lo]) + g_hi, lo, hi, g_hi))

    g_last, j_last = _evaluate(state, float(candidates[-1]))
    if math.isfinite(g_last):
        push(0, j_last, g_last)
    while heap:
        lower_bound, lo, hi, g_hi = heapq.heappop(heap)
        if state.lower_bound_beaten(lower_bound, epsilon):
            continue
        mid = (lo + hi) // 2
        g_mid, j_mid = _evaluate(state, float(candidates[mid]))
        if not math.isfinite(g_mid):
            push(mid + 1, hi, g_hi)
            continue
        push(lo, j_mid, g_mid)
        if g_mid > g_hi:
            push(mid + 1, hi, g_hi)


def _evaluate(state: _Search, t_max: float) -> tuple[float, int]:
    """``G(t_max)`` and the candidate index of its pipeline's slowest stage; keeps the best.

    ``(inf, -1)`` when no pipeline has every stage within ``t_max``.
    """
    problem, tables = state.problem, state.tables
    state.num_tried += 1
    cost = np.where(tables.latency <= t_max, tables.latency, np.inf)
    links = None
    if tables.discount is not None:
        assert tables.inside is not None and state.discounted is not None
        # Stages inside a host: within t_max at their discounted latency (the same float
        # operation as the candidates and `_placements`).
        inside = np.where(state.discounted <= t_max, tables.latency, np.inf)
        links = (inside, tables.discount, tables.inside)
    f, p = sweep(cost, tables.sizes, problem.cluster.num_devices, mask=tables.mask,
                 links=links)
    g = float(f[1:, 0, -1].min())
    if not math.isfinite(g):
        return g, -1
    path = backtrack(cost, f, p, tables.sizes, mask=tables.mask, links=links)
    assert path is not None
    stages = _placements(problem, tables, path)
    latencies = tuple(s.option.latency for s in stages)
    total = pipeline_latency(latencies, problem.num_microbatches)
    if total < state.total:
        state.total, state.stages = total, stages
    return g, int(np.searchsorted(state.candidates, max(latencies)))


def _placements(problem: PipelineProblem, tables: StageTables,
                path: list[tuple[int, int, int, int]]) -> tuple[StagePlacement, ...]:
    """`StagePlacement`s of a DP path, with the schedule's in-flight count at each position."""
    num_stages = len(path)
    placements, offset = [], 0
    for index, (start, end, m, bucket) in enumerate(path):
        option = tables.options[(start, end, m)][int(tables.choice[bucket - 1, start, end, m])]
        if tables.discount is not None and index and \
                inside_host(offset, problem.cluster.devices_per_host):
            option = replace(option, latency=float(option.latency - tables.discount[start, m]))
        offset += int(tables.sizes[m])
        in_flight = problem.in_flight(index, num_stages, problem.num_microbatches)
        placements.append(StagePlacement(start, end, tables.shapes[m], option, in_flight))
    return tuple(placements)


def min_memory_bytes(problem: PipelineProblem, tables: StageTables) -> float:
    """Smallest per-device memory with which some pipeline fits, ignoring latency (inf if none).

    The same sweep with ``max`` for ``+`` (a bottleneck path) over `memory_need`'s rows.
    """
    f, _ = sweep(memory_need(tables), tables.sizes, problem.cluster.num_devices, np.maximum,
                 tables.mask)
    return float(f[1:, 0, -1].min())


def _no_pipeline(problem: PipelineProblem, tables: StageTables) -> NoPipelineError:
    """The NoPipelineError saying why nothing is feasible, with the memory that would do."""
    cluster = problem.cluster
    where = (f"{problem.num_layers} layers on a {cluster.num_hosts}x{cluster.devices_per_host} "
             f"cluster with {problem.num_microbatches} micro-batches")
    need = min_memory_bytes(problem, tables)
    if not math.isfinite(need):
        return NoPipelineError(
            f"no pipeline for {where}: no split into contiguous stages on submeshes using all "
            f"{cluster.num_devices} devices has a profiled option for every stage",
            problem.device_memory, need)
    return NoPipelineError(
        f"no pipeline for {where} fits device_memory={problem.device_memory!r} bytes; the "
        f"smallest-memory pipeline needs {need!r} bytes per device", problem.device_memory, need)
