"""The shard-ratio LP (HAP §5.1 with memory rows; `planner/hetero/load_balance.py`)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from meshplan.planner.hetero.load_balance import (Device, Phase, balance, step_time,
                                                  whole_rows)

V100, P100 = 3.86e12, 2.15e12   # HAP's profiled fp32 training speeds (perf_tables.md §3)


def test_equal_devices_get_equal_shares() -> None:
    b = balance([Phase(1e12, alpha_s=1e-3, beta_s_per_share=0.5)], [Device(V100)] * 4)
    assert b.ratios == pytest.approx((0.25,) * 4)


def test_compute_alone_splits_in_proportion_to_speed() -> None:
    """DP-CP: with nothing but split work each device's share is its share of the speed."""
    devices = [Device(V100)] * 2 + [Device(P100)] * 6
    b = balance([Phase(4e12), Phase(1e12)], devices)
    total = 2 * V100 + 6 * P100
    assert b.ratios == pytest.approx([V100 / total] * 2 + [P100 / total] * 6)
    assert b.step_s == pytest.approx(5e12 / total)


def test_padded_collectives_pull_shares_toward_even() -> None:
    """A padded all-gather costs with the largest share, so when it dominates, shares even
    out (HAP Fig. 2: EV wins when communication is the bottleneck); a grouped broadcast's
    cost does not depend on the ratios and leaves them proportional."""
    devices = [Device(2.0), Device(1.0)]
    compute_bound = balance([Phase(3.0, beta_s_per_share=0.1)], devices).ratios
    comm_bound = balance([Phase(3.0, beta_s_per_share=100.0)], devices).ratios
    broadcast = balance([Phase(3.0, alpha_s=50.0)], devices).ratios
    assert compute_bound == pytest.approx((2 / 3, 1 / 3))
    assert comm_bound == pytest.approx((0.5, 0.5))
    assert broadcast == pytest.approx((2 / 3, 1 / 3))


def test_replicated_work_is_kept_as_its_constant() -> None:
    """The slow device also spends longer on the replicated part, so it gets less of the
    split one than its speed alone would give."""
    devices = [Device(2.0), Device(1.0)]
    plain = balance([Phase(3.0)], devices).ratios
    fixed = balance([Phase(3.0, fixed_s=(0.25, 0.5))], devices).ratios
    assert fixed[1] < plain[1]
    # Both devices finish together: 3 r0 / 2 + 0.25 = 3 r1 + 0.5.
    assert 1.5 * fixed[0] + 0.25 == pytest.approx(3 * fixed[1] + 0.5)


@pytest.mark.parametrize("seed", range(25))
def test_the_lp_is_no_worse_than_any_ratios(seed: int) -> None:
    """Optimality, checked against random points of the simplex and the corners of a grid."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    devices = [Device(rng.uniform(1, 5), rng.choice((math.inf, rng.uniform(2, 6))),
                      rng.uniform(0, 1)) for _ in range(n)]
    phases = [Phase(rng.uniform(0, 10), tuple(rng.uniform(0, 1) for _ in range(n))
                    if rng.random() < 0.5 else (), rng.uniform(0, 1), rng.uniform(0, 20))
              for _ in range(rng.randint(1, 4))]
    shared = rng.choice((0.0, rng.uniform(1, 8)))
    try:
        best = balance(phases, devices, shared)
    except ValueError:
        return   # memory no ratios meet (tested below)
    assert sum(best.ratios) == pytest.approx(1.0)
    for r, d in zip(best.ratios, devices):
        assert d.state_bytes + r * shared <= d.memory_bytes * (1 + 1e-9) + 1e-9
    for _ in range(400):
        w = [rng.random() for _ in range(n)]
        ratios = [x / sum(w) for x in w]
        if all(d.state_bytes + r * shared <= d.memory_bytes for r, d in zip(ratios, devices)):
            assert best.step_s <= step_time(phases, devices, ratios) + 1e-9


def test_memory_rows_cap_a_small_fast_device() -> None:
    """Fast with little room: its share stops where its memory does (HAP has no such row)."""
    devices = [Device(4.0, memory_bytes=10.0, state_bytes=6.0), Device(1.0, 100.0, 6.0)]
    free = balance([Phase(5.0)], devices).ratios
    capped = balance([Phase(5.0)], devices, shared_bytes=20.0)
    assert free == pytest.approx((0.8, 0.2))
    assert capped.ratios == pytest.approx((0.2, 0.8))   # (10 - 6) / 20


def test_memory_no_ratios_meet_is_refused_with_what_would_do() -> None:
    devices = [Device(1.0, 10.0, 8.0), Device(1.0, 10.0, 8.0)]
    with pytest.raises(ValueError, match="holds 0.400 of the split data.*2.50x more memory"):
        balance([Phase(1.0)], devices, shared_bytes=10.0)
    with pytest.raises(ValueError, match="devices \\[1\\] hold more than their memory"):
        balance([Phase(1.0)], [Device(1.0, 10.0), Device(1.0, 10.0, 11.0)])
    with pytest.raises(ValueError, match="phase 0 lists fixed seconds for 1 devices, not 2"):
        balance([Phase(1.0, (0.1,))], [Device(1.0), Device(1.0)])


@pytest.mark.parametrize("ratios,length", [((0.5, 0.3, 0.2), 10), ((0.4, 0.3, 0.2, 0.1), 7),
                                           ((1 / 3, 1 / 3, 1 / 3), 8), ((0.7, 0.3), 1),
                                           ((0.26, 0.26, 0.24, 0.24), 2), ((1.0, 0.0), 5)])
def test_whole_rows_sum_to_the_length_with_the_least_rounding_error(ratios, length) -> None:
    rows = whole_rows(ratios, length)
    assert sum(rows) == length and min(rows) >= 0
    exact = [r / sum(ratios) * length for r in ratios]
    error = sum(abs(a - b) for a, b in zip(rows, exact))
    best = min(sum(abs(a - b) for a, b in zip(split, exact))
               for split in itertools.product(range(length + 1), repeat=len(ratios))
               if sum(split) == length)
    assert error == pytest.approx(best)


def test_whole_rows_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="length must be >= 0"):
        whole_rows((0.5, 0.5), -1)
    with pytest.raises(ValueError, match="positive sum"):
        whole_rows((0.0, 0.0), 4)


def test_segments_get_ratios_of_their_own() -> None:
    """HAP §5.2: a compute-bound segment splits by speed, a communication-bound one evenly;
    one ratio for the whole model is worse than both."""
    devices = [Device(2.0), Device(1.0)]
    compute = Phase(3.0, beta_s_per_share=0.1, segment=0)
    comm = Phase(3.0, beta_s_per_share=100.0, segment=1)
    b = balance([compute, comm], devices)
    assert b.segments[0] == pytest.approx((2 / 3, 1 / 3))
    assert b.segments[1] == pytest.approx((0.5, 0.5))
    one = balance([Phase(3.0, beta_s_per_share=0.1), Phase(3.0, beta_s_per_share=100.0)],
                  devices)
    assert b.step_s < one.step_s
    assert b.step_s == pytest.approx(step_time([compute, comm], devices, b.segments))


def test_segments_share_each_devices_memory() -> None:
    """Every segment's share is held at once: the fast device's room (4 bytes) is split
    between the two segments' data, not given whole to each as separate LPs would."""
    devices = [Device(4.0, memory_bytes=10.0, state_bytes=6.0), Device(1.0, 100.0, 6.0)]
    phases = [Phase(5.0, segment=0), Phase(5.0, segment=1)]
    b = balance(phases, devices, shared_bytes=(10.0, 10.0))
    fast_bytes = 10.0 * b.segments[0][0] + 10.0 * b.segments[1][0]
    assert fast_bytes == pytest.approx(4.0)
    alone = balance([Phase(5.0)], devices, shared_bytes=10.0).ratios
    assert alone[0] == pytest.approx(0.4) and b.segments[0][0] < alone[0] + 1e-9


def test_segments_need_shared_bytes_each() -> None:
    phases = [Phase(1.0, segment=0), Phase(1.0, segment=1)]
    with pytest.raises(ValueError, match="give shared_bytes per segment"):
        balance(phases, [Device(1.0)] * 2, shared_bytes=4.0)
    with pytest.raises(ValueError, match="shared_bytes lists 3 segments; the phases fill 2"):
        balance(phases, [Device(1.0)] * 2, shared_bytes=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="segment must be >= 0"):
        balance([Phase(1.0, segment=-1)], [Device(1.0)])


@pytest.mark.parametrize("seed", range(15))
def test_the_segmented_lp_is_no_worse_than_any_ratios(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n, g = rng.randint(2, 3), rng.randint(2, 3)
    devices = [Device(rng.uniform(1, 5), rng.uniform(6, 12), rng.uniform(0, 1))
               for _ in range(n)]
    phases = [Phase(rng.uniform(0, 10), (), rng.uniform(0, 1), rng.uniform(0, 20), seg)
              for seg in range(g) for _ in range(rng.randint(1, 2))]
    shared = tuple(rng.uniform(1, 6) for _ in range(g))
    best = balance(phases, devices, shared)
    for _ in range(400):
        ratios = []
        for _ in range(g):
            w = [rng.random() for _ in range(n)]
            ratios.append([x / sum(w) for x in w])
        held = [d.state_bytes + sum(ratios[k][j] * shared[k] for k in range(g))
                for j, d in enumerate(devices)]
        if all(h <= d.memory_bytes for h, d in zip(held, devices)):
            assert best.step_s <= step_time(phases, devices, ratios) + 1e-9
