"""Interleaved 1F1B (Megatron-LM's virtual stages) for a pipeline's meshes.

Given the S stage meshes a pipeline runs on (the search's best 1F1B pipeline, or a Megatron
configuration's ``pp`` meshes) and v chunks per mesh, the model is cut into S·v virtual stages
of L / (S·v) clustered layers each, virtual stage k on mesh k % S (Megatron's assignment: mesh i
runs chunks i, i + S, …). Each virtual stage takes an option of its layers on its mesh; the
step is the interleaved form of eq. 2 (`stage_problem.pipeline_latency`), and memory is checked
per mesh: the sum over its chunks of state plus activations at each chunk's own in-flight peak
under the schedule's clock table (`lower/schedules.py`), an upper bound of the mesh's peak.

Choosing the options: per mesh, every chunk its fastest option, then while the mesh is over the
budget the swap to a leaner option that costs the least latency per byte saved (the chunks of a
mesh share its memory, so they cannot be chosen one by one as 1F1B's stages are).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from meshplan.errors import NoPipelineError
from meshplan.lower.schedules import make_schedule
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_problem import (DpStats, PipelineSolution, StageOption,
                                                  StagePlacement, Submesh, make_solution)

MAX_CHUNKS = 8   # Megatron-LM's recipes interleave 2-8 chunks per device


def chunk_counts(num_layers: int, num_meshes: int, microbatches: int) -> list[int]:
    """The chunk counts v >= 2 (at most `MAX_CHUNKS`) an interleaved pipeline of
    ``num_meshes`` meshes can use: v·S divides the layers, and the micro-batches come in
    groups of S (empty if none)."""
    if num_meshes < 2 or microbatches % num_meshes:
        return []
    return [v for v in range(2, MAX_CHUNKS + 1) if num_layers % (v * num_meshes) == 0]


def interleave(profiler: StageProfiler, meshes: list[Submesh], chunks: int,
               budget: float | None, keep: Callable[[StageOption], bool] = lambda o: True
               ) -> PipelineSolution | NoPipelineError:
    """The interleaved pipeline of ``chunks`` per mesh on ``meshes`` (module docstring), with
    options ``keep`` allows; a NoPipelineError with the memory the leanest options need when a
    mesh does not fit. Raises ValueError when the layers or micro-batches do not split."""
    t0 = time.perf_counter()
    s, b = len(meshes), profiler.microbatches
    layers = profiler.layering.num_layers
    if chunks not in chunk_counts(layers, s, b):
        raise ValueError(f"interleaved 1F1B with {chunks} chunks on {s} meshes needs the "
                         f"{layers} layers to split into {s * chunks} equal chunks and the "
                         f"{b} micro-batches to be a multiple of {s}; valid chunk counts: "
                         f"{chunk_counts(layers, s, b) or 'none'}")
    schedule = make_schedule("interleaved", s, b, chunks)
    per = layers // (s * chunks)
    limit = math.inf if budget is None else budget
    chosen: dict[int, StagePlacement] = {}
    for i, submesh in enumerate(meshes):
        stages = list(range(i, s * chunks, s))
        options = {k: [o for o in profiler(k * per, (k + 1) * per, submesh) if keep(o)]
                   for k in stages}
        held = {k: schedule.in_flight_of(k) for k in stages}
        if any(not options[k] for k in stages):
            return NoPipelineError(f"chunk of layers on {submesh} has no option", budget,
                                   math.inf)
        pick = _fit_mesh(options, held, limit)
        if pick is None:
            need = math.fsum(min(o.memory_bytes(held[k]) for o in options[k]) for k in stages)
            return NoPipelineError(f"mesh {i} ({submesh}) with {chunks} chunks does not fit",
                                   budget, need)
        for k in stages:
            chosen[k] = StagePlacement(k * per, (k + 1) * per, submesh, pick[k], held[k])
    placements = tuple(chosen[k] for k in range(s * chunks))
    return make_solution(placements, b, DpStats(0, s * chunks, time.perf_counter() - t0),
                         chunks)


def _fit_mesh(options: dict[int, list[StageOption]], held: dict[int, int], limit: float
              ) -> dict[int, StageOption] | None:
    """One option per chunk of a mesh, fastest first, made leaner greedily until the chunks'
    memory sums within ``limit`` (module docstring); None if even the leanest do not."""
    pick = {k: min(opts, key=lambda o: o.latency) for k, opts in options.items()}

    def total() -> float:
        return math.fsum(pick[k].memory_bytes(held[k]) for k in pick)

    while total() > limit:
        best, best_rate = None, math.inf
        for k, opts in options.items():
            now = pick[k].memory_bytes(held[k])
            for o in opts:
                saved = now - o.memory_bytes(held[k])
                if saved > 0:
                    rate = max(o.latency - pick[k].latency, 0.0) / saved
                    if rate < best_rate:
                        best, best_rate = (k, o), rate
        if best is None:
            return None
        pick[best[0]] = best[1]
    return pick
