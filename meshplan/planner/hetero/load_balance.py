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

Segments (HAP §5.2): the model's phases may be cut into segments, each with ratios of its own
(an all-to-all at each boundary re-splits the data, priced by the caller as a phase). HAP
solves each segment alone; with memory rows they share each device's memory — a device holds
every segment's share at once — so here they are one LP: ``r_kj`` per segment ``k``, each
segment's shares summing to 1, and ``state_j + sum_k r_kj · shared_k <= memory_j``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from meshplan.cost.checks import check_nonnegative, check_positive


@dataclass(frozen=True)
class Phase:
    """One phase of the program: ``flops`` of split work (shared by the ratios), the seconds
    of its replicated work on each device (``fixed_s``, one per device; empty: none), and its
    collectives' latency ``alpha_s`` and seconds per byte of the largest share
    ``beta_s_per_share`` (a padded all-gather of ``B`` bytes over ``n`` devices: ``(n - 1) · B
    · β``; 0 for grouped broadcasts, whose time does not depend on the ratios).

    ``split_s`` instead of ``flops``: the seconds each device would take for the whole split
    work (a roofline time: memory-bound work does not scale with FLOP/s); ``flops`` is then
    left 0."""

    flops: float
    fixed_s: tuple[float, ...] = ()
    alpha_s: float = 0.0
    beta_s_per_share: float = 0.0
    segment: int = 0   # whose ratios split its work (module docstring)
    split_s: tuple[float, ...] = ()

    def seconds_per_share(self, devices: Sequence["Device"]) -> list[float]:
        """Seconds device j spends per unit of its share ``r_j``."""
        if self.split_s:
            return list(self.split_s)
        return [self.flops / d.speed for d in devices]


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
    """Each segment's ratios (each summing to 1) and the step time they give
    (`step_time`); ``ratios`` is segment 0's."""

    segments: tuple[tuple[float, ...], ...]
    step_s: float

    @property
    def ratios(self) -> tuple[float, ...]:
        return self.segments[0]


def step_time(phases: Sequence[Phase], devices: Sequence[Device],
              ratios: Sequence[float] | Sequence[Sequence[float]]) -> float:
    """``T(r)`` of the module docstring, evaluated directly; ``ratios`` one list for every
    phase, or one per segment."""
    per_segment = [list(r) for r in ratios] if ratios and isinstance(ratios[0], Sequence) \
        else [list(ratios)]  # type: ignore[arg-type]
    total = 0.0
    for p in phases:
        r = per_segment[p.segment]
        fixed = p.fixed_s or (0.0,) * len(devices)
        per = p.seconds_per_share(devices)
        total += max(a * x + f for x, a, f in zip(r, per, fixed))
        total += p.alpha_s + p.beta_s_per_share * max(r)
    return total


def balance(phases: Sequence[Phase], devices: Sequence[Device],
            shared_bytes: float | Sequence[float] = 0.0) -> Balance:
    """The ratios minimizing the step (module docstring) with every device's memory held:
    ``state_bytes + sum_k r_kj · shared_bytes[k] <= memory_bytes`` (``shared_bytes`` one
    figure per segment, or one for a single segment). Raises ValueError for no devices, a
    phase whose ``fixed_s`` does not list every device, ``shared_bytes`` not one per segment,
    or memory no ratios can meet (saying how much more would do)."""
    n = len(devices)
    if n == 0:
        raise ValueError("balance needs at least one device")
    for d in devices:
        check_positive(d.speed, "Device.speed")
        check_nonnegative(d.state_bytes, "Device.state_bytes")
    for i, p in enumerate(phases):
        for what, vals in (("fixed", p.fixed_s), ("split", p.split_s)):
            if vals and len(vals) != n:
                raise ValueError(f"phase {i} lists {what} seconds for {len(vals)} devices, "
                                 f"not {n}")
    shared = _per_segment(phases, shared_bytes)
    _check_memory(devices, sum(shared))
    g, k = len(shared), len(phases)
    # Columns: r (segment-major, g x n), c_0..c_{k-1} (each phase's compute), m_0..m_{g-1}
    # (each segment's largest share).
    c0, m0 = g * n, g * n + k
    cols = m0 + g
    cost = np.zeros(cols)
    cost[c0:m0] = 1.0
    for p in phases:
        cost[m0 + p.segment] += p.beta_s_per_share
    rows, upper = [], []
    for i, p in enumerate(phases):
        fixed = p.fixed_s or (0.0,) * n
        for j, a in enumerate(p.seconds_per_share(devices)):
            row = np.zeros(cols)   # flops r_kj / speed_j - c_i <= -fixed_ij
            row[p.segment * n + j], row[c0 + i] = a, -1.0
            rows.append(row)
            upper.append(-fixed[j])
    for seg in range(g):
        for j in range(n):
            row = np.zeros(cols)   # r_kj - m_k <= 0
            row[seg * n + j], row[m0 + seg] = 1.0, -1.0
            rows.append(row)
            upper.append(0.0)
    for j, d in enumerate(devices):
        if math.isfinite(d.memory_bytes) and any(shared):
            row = np.zeros(cols)   # sum_k r_kj shared_k <= memory_j - state_j
            row[j:g * n:n] = shared
            rows.append(row)
            upper.append(d.memory_bytes - d.state_bytes)
    equal = np.zeros((g, cols))
    for seg in range(g):
        equal[seg, seg * n:(seg + 1) * n] = 1.0
    bounds = [(0.0, 1.0)] * (g * n) + [(None, None)] * (k + g)
    # Imported here: scipy.optimize is a second of every `meshplan` command's start (most plans
    # never balance shards) and of every rank's.
    from scipy.optimize import linprog
    out = linprog(cost, A_ub=np.array(rows), b_ub=np.array(upper), A_eq=equal,
                  b_eq=np.ones(g), bounds=bounds, method="highs")
    if out.status != 0:
        raise RuntimeError(f"the shard-ratio LP did not solve: {out.message}")
    segments = []
    for seg in range(g):
        r = [max(float(x), 0.0) for x in out.x[seg * n:(seg + 1) * n]]
        segments.append(tuple(x / math.fsum(r) for x in r))
    return Balance(tuple(segments), step_time(phases, devices, segments))


def _per_segment(phases: Sequence[Phase], shared_bytes: float | Sequence[float]
                 ) -> list[float]:
    """``shared_bytes`` as one figure per segment the phases fill (a single number only for
    one segment, or 0 for none)."""
    if any(p.segment < 0 for p in phases):
        raise ValueError("a phase's segment must be >= 0")
    g = max((p.segment for p in phases), default=0) + 1
    if isinstance(shared_bytes, (int, float)):
        if g > 1 and shared_bytes:
            raise ValueError(f"the phases fill {g} segments: give shared_bytes per segment")
        shared = [float(shared_bytes)] + [0.0] * (g - 1)
    else:
        shared = [float(x) for x in shared_bytes]
        if len(shared) != g:
            raise ValueError(f"shared_bytes lists {len(shared)} segments; the phases fill {g}")
    for x in shared:
        check_nonnegative(x, "shared_bytes")
    return shared


def _check_memory(devices: Sequence[Device], shared: float) -> None:
    """Refuse memory no ratios meet: a device takes at most its free memory, and at most all
    of the split data."""
    over = [j for j, d in enumerate(devices) if d.state_bytes > d.memory_bytes]
    if over:
        raise ValueError(f"devices {over} hold more than their memory before any share "
                         f"(state_bytes > memory_bytes): no ratios fit")
    if shared <= 0:
        return
    room = math.fsum(min((d.memory_bytes - d.state_bytes) / shared, 1.0) for d in devices)
    if room < 1.0:
        raise ValueError(f"the devices' free memory holds {room:.3f} of the split data "
                         f"({shared:.4g} bytes): {1 / room:.2f}x more memory (or a smaller "
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
