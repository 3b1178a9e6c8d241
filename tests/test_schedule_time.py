"""A pipeline's step as its schedule runs (`planner/inter/schedule_time.py`): eq. 2 where
nothing is sent, no more than eq. 2 where sends overlap compute, and many micro-batches
extrapolated within a hair of running them all."""

from __future__ import annotations

import random

import pytest

from meshplan.planner.inter.schedule_time import DIRECT_ROUNDS, _run, scheduled_latency
from meshplan.planner.inter.stage_problem import pipeline_latency


def _case(rng: random.Random) -> tuple[list[float], list[float], int, str, int]:
    meshes = rng.choice([1, 2, 3, 4, 6, 8])
    chunks = rng.choice([1, 1, 2, 3]) if meshes > 1 else 1
    schedule = "interleaved" if chunks > 1 else rng.choice(["1f1b", "gpipe"])
    stages = meshes * chunks
    compute = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    transfer = [0.0] + [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(stages - 1)]
    b = meshes * rng.randint(1, 3 * DIRECT_ROUNDS) if chunks > 1 else rng.randint(1, 120)
    return compute, transfer, b, schedule, chunks


def test_without_transfers_gpipe_is_eq2_and_1f1b_no_slower() -> None:
    rng = random.Random(0)
    for _ in range(60):
        stages = rng.randint(1, 6)
        compute = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        b = rng.randint(1, 40)
        eq2 = pipeline_latency(tuple(compute), b)
        none = [0.0] * stages
        assert scheduled_latency(compute, none, b, "gpipe") == pytest.approx(eq2, rel=1e-9)
        assert scheduled_latency(compute, none, b, "1f1b") <= eq2 * (1 + 1e-9)


def test_asynchronous_sends_cost_at_most_eq2_and_at_least_the_busiest_stage() -> None:
    """Eq. 2 charges each transfer in the pace; the runtime sends while it computes, so the
    schedule is never slower than that, and never faster than its busiest mesh's compute or
    one micro-batch's way through every stage and boundary."""
    rng = random.Random(1)
    for _ in range(150):
        compute, transfer, b, schedule, chunks = _case(rng)
        got = scheduled_latency(compute, transfer, b, schedule, chunks)
        priced = tuple(c + x for c, x in zip(compute, transfer))
        assert got <= pipeline_latency(priced, b, chunks) * (1 + 3e-3)
        meshes = len(compute) // chunks
        busiest = max(sum(compute[m::meshes]) for m in range(meshes))
        assert got >= b * busiest * (1 - 1e-9)
        assert got >= sum(priced) * (1 - 1e-9)


def test_a_slow_boundary_costs_less_than_eq2_says() -> None:
    """Eight stages with one slow boundary (a host's edge): eq. 2 paces every micro-batch at
    the slow stage's compute plus its transfer; the schedule hides most of the transfer."""
    compute, transfer = [1.0] * 8, [0.0, 0.01, 0.01, 0.01, 0.5, 0.01, 0.01, 0.01]
    got = scheduled_latency(compute, transfer, 512)
    eq2 = pipeline_latency(tuple(c + x for c, x in zip(compute, transfer)), 512)
    assert got < 0.9 * eq2
    assert got > 512 * 1.0


def test_many_micro_batches_extrapolated_within_a_hair_of_running_them() -> None:
    rng = random.Random(2)
    extrapolated = 0
    for _ in range(60):
        compute, transfer, b, schedule, chunks = _case(rng)
        meshes = len(compute) // chunks
        if b <= (DIRECT_ROUNDS + 2) * meshes:
            continue
        extrapolated += 1
        assert scheduled_latency(compute, transfer, b, schedule, chunks) == pytest.approx(
            _run(compute, transfer, b, schedule, chunks), rel=5e-3)
    assert extrapolated >= 10


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="one transfer per stage"):
        scheduled_latency([1.0, 1.0], [0.0], 4)
