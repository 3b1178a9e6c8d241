"""Brute-force oracle for the stage DP: enumerate every pipeline and evaluate eq. 2 directly.

Every split of the layers into contiguous stages, every sequence of submesh shapes whose devices
sum to ``N * M``, every option per stage that fits memory at its position; exponential, for tests
on a handful of layers and devices only.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

from meshplan.errors import NoPipelineError
from meshplan.planner.inter.stage_problem import (
    DpStats,
    PipelineProblem,
    PipelineSolution,
    StageOption,
    StagePlacement,
    Submesh,
    laid_in_order,
    linked,
    make_solution,
    pipeline_latency,
    submesh_shapes,
)


def _splits(num_layers: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every split of ``0..L-1`` into contiguous ranges ``(start, end)``."""
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [num_layers]
        yield tuple(zip(bounds, bounds[1:]))


def _mesh_sequences(shapes: tuple[Submesh, ...], num_stages: int,
                    num_devices: int) -> Iterator[tuple[Submesh, ...]]:
    """Every sequence of ``num_stages`` shapes whose devices sum to ``num_devices``."""
    for seq in itertools.product(shapes, repeat=num_stages):
        if sum(h * d for h, d in seq) == num_devices:
            yield seq


def brute_force(problem: PipelineProblem) -> PipelineSolution:
    """The optimal pipeline by exhaustive enumeration (same result type as `solve_stage_dp`).

    Raises NoPipelineError when no pipeline is feasible (its ``min_memory_bytes`` is not
    computed: left at inf).
    """
    began = time.perf_counter()
    shapes, b = submesh_shapes(problem.cluster), problem.num_microbatches
    cache: dict[tuple[int, int, Submesh], tuple[StageOption, ...]] = {}

    def profile(start: int, end: int, mesh: Submesh) -> tuple[StageOption, ...]:
        if (start, end, mesh) not in cache:
            cache[(start, end, mesh)] = tuple(problem.profile(start, end, mesh))
        return cache[(start, end, mesh)]

    best_total, best = math.inf, None
    for ranges in _splits(problem.num_layers):
        num_stages = len(ranges)
        counts = [problem.in_flight(j, num_stages, b) for j in range(num_stages)]
        for meshes in _mesh_sequences(shapes, num_stages, problem.cluster.num_devices):
            usable = [[o for o in profile(start, end, mesh) if problem.fits(o, count)]
                      for (start, end), mesh, count in zip(ranges, meshes, counts)]
            for chosen in itertools.product(*usable):
                stages = tuple(StagePlacement(start, end, mesh, o, count) for (start, end), mesh,
                               o, count in zip(ranges, meshes, chosen, counts))
                if problem.links is not None:
                    if not laid_in_order(stages, problem.cluster.devices_per_host):
                        continue
                    stages = linked(stages, problem.links, problem.cluster.devices_per_host)
                total = pipeline_latency(tuple(s.option.latency for s in stages), b)
                if total < best_total:
                    best_total, best = total, stages
    if best is None:
        raise NoPipelineError(f"brute force: no feasible pipeline for {problem.num_layers} layers",
                              problem.device_memory)
    return make_solution(best, b, DpStats(0, len(cache), time.perf_counter() - began))

