"""A pipeline's step as the runtime runs its schedule, from its stages' latencies.

Alpa's eq. 2 (`stage_problem.pipeline_latency`) charges each stage its inbound transfer in the
pace, ``(B - 1) * max(compute + transfer)``. The runtime's sends are asynchronous (a stage
computes its next micro-batch while its last one's activations travel) and its receives
block, so a slow boundary costs less than that; but 1F1B keeps only S - i micro-batches in
flight at stage i, so a slow boundary still stalls the round trips through it. Neither bound
alone is the step. Here the schedule's own instruction lists (`lower/instructions.py`) run on
the simulator's clock (`sim/engine.py`) with each stage's compute and each boundary's transfer:
the step the simulator gives the plan, less the update, which no stage latency holds.

A stage latency is one micro-batch's forward and backward with its inbound transfer (activations
in, their gradients back, `StageProfiler.transfer_time`); the forward is taken as a third of the
compute and each direction as half the transfer (the boundary carries the same tensor both
ways). Many micro-batches are not run one by one: past a few rounds the schedule repeats, so
the step is extrapolated from two runs of fewer (exact once the timeline is periodic).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from meshplan.lower.instructions import mesh_programs
from meshplan.lower.schedules import make_schedule
from meshplan.sim.engine import TaskCost, simulate_programs

# Micro-batches run one by one up to this many rounds of the meshes; past it, extrapolated.
DIRECT_ROUNDS = 4


def scheduled_latency(compute: Sequence[float], transfer: Sequence[float],
                      microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """Seconds of one iteration's forwards and backwards of ``microbatches`` micro-batches
    through stages of ``compute`` seconds each (forward + backward of one micro-batch), stage
    k receiving over a boundary of ``transfer[k]`` seconds (both ways; ``transfer[0]`` is
    ignored), under ``schedule`` ("1f1b", "gpipe", or "interleaved" with ``chunks`` virtual
    stages per mesh, stage k on mesh k % S)."""
    if len(compute) != len(transfer) or not compute:
        raise ValueError(f"one transfer per stage: {len(compute)} stages, "
                         f"{len(transfer)} transfers")
    return _scheduled(tuple(compute), tuple(transfer), microbatches, schedule, chunks)


# The search times the pipeline it picks, and its plan times it again (GPT-3 175B: 3 runs of
# 1.1 s each, 2 distinct).
@functools.lru_cache(maxsize=64)
def _scheduled(compute: tuple[float, ...], transfer: tuple[float, ...], microbatches: int,
               schedule: str, chunks: int) -> float:
    meshes = len(compute) // chunks
    period = 2 * meshes   # a multiple of the meshes, as the interleaved schedule needs
    base = DIRECT_ROUNDS * meshes
    if microbatches <= base + period:
        return _run(compute, transfer, microbatches, schedule, chunks)
    first = _run(compute, transfer, base, schedule, chunks)
    second = _run(compute, transfer, base + period, schedule, chunks)
    rounds = (microbatches - base - period) / period
    return second + rounds * (second - first)


def _run(compute: Sequence[float], transfer: Sequence[float], microbatches: int,
         schedule: str, chunks: int) -> float:
    stages = len(compute)
    meshes = stages // chunks
    programs = mesh_programs(make_schedule(schedule, meshes, microbatches, chunks),
                             {s: [s + 1] for s in range(stages - 1)})
    costs = {s: TaskCost(c / 3, 2 * c / 3, 0.0, 0.0, 0.0) for s, c in enumerate(compute)}
    half = [x / 2 for x in transfer]

    def seconds(send, *_) -> float:
        # Activations travel to their reader, gradients back from it: the later stage's
        # boundary either way.
        return half[send.peer] if send.kind == "activation" else half[send.stage]

    return simulate_programs(programs, costs, lambda s: s % meshes, seconds).step_time_s
