"""Per-device shard ratios of a fixed SPMD program on devices of different speeds (HAP §5.1),
with memory rows (HAP has none).

The program runs as phases separated by synchronizing collectives. In phase ``i`` device ``j``
computes ``flops_i · r_j / speed_j + fixed_s_i(j)`` seconds (its share ``r_j`` of the split
work; the replicated work takes the same FLOPs on every device, so its seconds differ by
speed), then the phase's collectives run at the pace of the largest share: a padded
all-gather or reduce-scatter of a tensor of ``B`` bytes moves ``(n - 1) · max_j r_j · B``
(DESIGN.md §4), a grouped broadcast ``sum_j r_j · B = B`` whatever the ratios. The step is

    T(r) = sum_i [ max_j (flops_i r_j / speed_j + fixed_ij) + alpha_i + beta_i · max_j r_j ]

which is linear once ``c_i >= flops_i r_j / speed_j + fixed_ij`` and ``m >= r_j`` stand in for
the maxima: an LP, solved with HiGHS, with ``sum_j r_j = 1``, ``r_j >= 0`` and per device
``state_j + r_j · shared_bytes <= memory_j``. Shares of a dimension of ``L`` rows are then
rounded to whole rows as HAP §5.1 does (`whole_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import linprog

from meshplan.cost.checks import check_nonnegative, check_positive


@dataclass(frozen=True)
class Phase:
    """One phase of the program: ``flops`` of split work (shared by the ratios), the seconds
    of its replicated work on each device (``fixed_s``, one per device; empty: none), and its
    collectives' latency ``alpha_s`` and seconds per byte of the largest share
    ``beta_s_per_share`` (a padded all-gather of ``B`` bytes over ``n`` devices: ``(n - 1) · B
    · β``; 0 for grouped broadcasts, whose time does not depend on the ratios)."""

    flops: float
    fixed_s: tuple[float, ...] = ()
    alpha_s: float = 0.0
    beta_s_per_share: float = 0.0


@dataclass(frozen=True)
class Device:
    """A device as the balancer sees it: FLOP/s on the split work, memory in bytes, and the
    bytes it holds whatever its share (``state_bytes``: replicated parameters, their
    gradients and optimizer state)."""

    speed: float
    memory_bytes: float = math.inf
    state_bytes: float = 0.0


@dataclass(frozen=True)
class Balance:
    """The ratios (summing to 1) and the step time they give (`step_time`)."""

    ratios: tuple[float, ...]
    step_s: float


def step_time(phases: Sequence[Phase], devices: Sequence[Device],
              ratios: Sequence[float]) -> float:
    """``T(r)`` of the module docstring, evaluated directly."""
    total = 0.0
    largest = max(ratios)
    for p in phases:
        fixed = p.fixed_s or (0.0,) * len(devices)
        total += max(p.flops * r / d.speed + f for r, d, f in zip(ratios, devices, fixed))
        total += p.alpha_s + p.beta_s_per_share * largest
    return total


def balance(phases: Sequence[Phase], devices: Sequence[Device],
            shared_bytes: float = 0.0) -> Balance:
    """The ratios minimizing the step (module docstring) with every device's memory held:
    ``state_bytes + r_j · shared_bytes <= memory_bytes``. Raises ValueError for no devices, a
    phase whose ``fixed_s`` does not list every device, or memory no ratios can meet (saying
    how much more would do)."""
    n = len(devices)
    if n == 0:
        raise ValueError("balance needs at least one device")
    for d in devices:
        check_positive(d.speed, "Device.speed")
        check_nonnegative(d.state_bytes, "Device.state_bytes")
    for i, p in enumerate(phases):
        if p.fixed_s and len(p.fixed_s) != n:
            raise ValueError(f"phase {i} lists fixed seconds for {len(p.fixed_s)} devices, "
                             f"not {n}")
    check_nonnegative(shared_bytes, "shared_bytes")
    _check_memory(devices, shared_bytes)
    k = len(phases)
    # Columns: r_0..r_{n-1}, c_0..c_{k-1} (each phase's compute), m (the largest share).
    cols = n + k + 1
    cost = np.zeros(cols)
    cost[n:n + k] = 1.0
    cost[-1] = sum(p.beta_s_per_share for p in phases)
    rows, upper = [], []
    for i, p in enumerate(phases):
        fixed = p.fixed_s or (0.0,) * n
        for j, d in enumerate(devices):
            row = np.zeros(cols)   # flops r_j / speed_j - c_i <= -fixed_ij
            row[j], row[n + i] = p.flops / d.speed, -1.0
            rows.append(row)
            upper.append(-fixed[j])
    for j in range(n):
        row = np.zeros(cols)       # r_j - m <= 0
        row[j], row[-1] = 1.0, -1.0
        rows.append(row)
        upper.append(0.0)
    bounds = [(0.0, _share_cap(d, shared_bytes)) for d in devices] + [(None, None)] * (k + 1)
    equal = np.zeros((1, cols))
    equal[0, :n] = 1.0
    out = linprog(cost, A_ub=np.array(rows) if rows else None,
                  b_ub=np.array(upper) if upper else None, A_eq=equal, b_eq=[1.0],
                  bounds=bounds, method="highs")
    if out.status != 0:
        raise RuntimeError(f"the shard-ratio LP did not solve: {out.message}")
    ratios = tuple(max(float(x), 0.0) for x in out.x[:n])
    total = math.fsum(ratios)
    ratios = tuple(r / total for r in ratios)
    return Balance(ratios, step_time(phases, devices, ratios))


def _share_cap(device: Device, shared_bytes: float) -> float:
    if shared_bytes <= 0 or math.isinf(device.memory_bytes):
        return 1.0
    return min(max((device.memory_bytes - device.state_bytes) / shared_bytes, 0.0), 1.0)


def _check_memory(devices: Sequence[Device], shared_bytes: float) -> None:
    over = [j for j, d in enumerate(devices) if d.state_bytes > d.memory_bytes]
    if over:
        raise ValueError(f"devices {over} hold more than their memory before any share "
                         f"(state_bytes > memory_bytes): no ratios fit")
    room = math.fsum(_share_cap(d, shared_bytes) for d in devices)
    if room < 1.0:
        raise ValueError(f"the devices' free memory holds {room:.3f} of the split data "
                         f"({shared_bytes:.4g} bytes): {1 / room:.2f}x more memory (or a smaller "
                         "batch) would fit")


def whole_rows(ratios: Sequence[float], length: int) -> tuple[int, ...]:
    """``length`` rows split by ``ratios`` into whole rows (HAP §5.1): each share rounded to
    the nearest integer, then while the sum is off, the share whose change by one row adds
    the least rounding error moves one row. Raises ValueError for a negative length or ratios
    that are negative or do not sum to a positive number."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not ratios or min(ratios) < 0 or not math.fsum(ratios) > 0:
        raise ValueError(f"ratios must be >= 0 with a positive sum, got {list(ratios)}")
    total = math.fsum(ratios)
    exact = [r / total * length for r in ratios]
    rows = [round(x) for x in exact]
    while sum(rows) != length:
        step = 1 if sum(rows) < length else -1
        candidates = [j for j in range(len(rows)) if rows[j] + step >= 0]
        j = min(candidates, key=lambda j: (abs(rows[j] + step - exact[j]) -
                                           abs(rows[j] - exact[j]), j))
        rows[j] += step
    return tuple(rows)
