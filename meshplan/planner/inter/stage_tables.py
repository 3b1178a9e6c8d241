"""The stage DP's engine: profile tables and one backward sweep of Alpa's recurrence (eq. 3).

Stages are counted from the end: a stage starting at layer ``k`` with ``r`` stages left (itself
included) holds ``counts[r]`` micro-batches (`resolve_in_flight_counts`), so its usable options
depend on ``r`` only. Per bucket ``r`` and triple ``(k, i, m)`` (layers ``[k, i)`` on submesh
``m``) the tables keep the fastest option that fits memory::

    c_r(k, i, m) = min { o.latency : o in profile(k, i, m), o fits with counts[r] in flight }

Rows ``r`` beyond some ``R`` are all equal (e.g. 1F1B once ``r >= B``, or ample memory), so
bucket ``R`` means "R or more stages left" and the DP has R + 1 buckets instead of L. With
``n_m`` the devices of submesh ``m`` and ``(+)`` the combine operator (``+`` for latency, ``max``
for memory), the sweep computes for ``k = L-1 .. 0`` (eq. 3, with its threshold folded into
``c``: entries above ``t_max`` are set to infinity by the caller)::

    F(0, L, 0) = 0
    F(r, k, d) = min_{i > k, m} c_r(k, i, m) (+) P_r(i, d - n_m)   [+ mask(m, d)]
    P_r = F(r - 1)                       for r < R
    P_R = min(F(R - 1), F(R))            (one more stage, still in bucket R, or exactly R - 1)

On a cluster of mixed devices (`DeviceKinds`) the submeshes are typed, one per kind, and
``mask(m, d)`` (0 or inf) lets a stage of shape ``m`` start with ``d`` devices left only where
those positions are of its kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from meshplan.planner.inter.stage_problem import (
    PipelineProblem,
    StageOption,
    Submesh,
    inside_host,
    placeable,
    resolve_in_flight_counts,
    submesh_shapes,
    triple_index,
)


@dataclass(frozen=True, eq=False)
class StageTables:
    """Profiled options of every triple plus the per-bucket best-option tables.

    ``options[(k, i, m)]``: the profile's options for layers ``[k, i)`` on ``shapes[m]``.
    ``latency[b, k, i, m]``: ``c_{b+1}`` above (inf = unusable); ``choice`` the index of that
    option in ``options[(k, i, m)]`` (-1 if none); rows ``r >= R`` equal row ``R``.
    ``counts[r]``: in-flight micro-batches with ``r`` stages left; ``sizes[m]``: devices of
    ``shapes[m]``; ``flat``: every option as columns (latency, state, activation, flat triple
    index, position in its tuple).
    """

    shapes: tuple[Submesh, ...]
    sizes: np.ndarray
    counts: tuple[int, ...]
    options: Mapping[tuple[int, int, int], tuple[StageOption, ...]]
    flat: dict[str, np.ndarray]
    latency: np.ndarray
    choice: np.ndarray
    mask: np.ndarray | None = None
    # With `Links`: ``discount[k, m]`` a stage from layer k on shapes[m] saves when its
    # inbound boundary is inside a host, and ``inside[d]`` whether the boundary of a stage
    # starting with d devices left is (`link_arrays`); ``mask`` then holds the placeable ones.
    discount: np.ndarray | None = None
    inside: np.ndarray | None = None

    @property
    def num_buckets(self) -> int:
        return self.latency.shape[0]


def profile_all(problem: PipelineProblem, shapes: tuple[Submesh, ...]
                ) -> dict[tuple[int, int, int], tuple[StageOption, ...]]:
    """Ask ``problem.profile`` once per triple ``(start, end, shape index)``.

    Raises TypeError when the profile returns anything but a tuple/list of `StageOption`.
    """
    options = {}
    for k in range(problem.num_layers):
        for i in range(k + 1, problem.num_layers + 1):
            for m, shape in enumerate(shapes):
                got = problem.profile(k, i, shape)
                if not isinstance(got, (tuple, list)) or not all(
                        isinstance(o, StageOption) for o in got):
                    raise TypeError(f"profile({k}, {i}, {shape}) must return a tuple of "
                                    f"StageOption, got {got!r}")
                options[(k, i, m)] = tuple(got)
    return options


class _AskedOnUse(Mapping):
    """``options`` of a bulk-priced problem (`PipelineProblem.table`): every triple, each asked
    of the profile only when read (the DP reads the stages it picks)."""

    def __init__(self, problem: PipelineProblem, shapes: tuple[Submesh, ...]) -> None:
        self._problem, self._shapes, self._asked = problem, shapes, {}
        n = problem.num_layers
        self._len = n * (n + 1) // 2 * len(shapes)

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[StageOption, ...]:
        if key not in self._asked:
            k, i, m = key
            if not (0 <= k < i <= self._problem.num_layers and 0 <= m < len(self._shapes)):
                raise KeyError(key)
            self._asked[key] = tuple(self._problem.profile(k, i, self._shapes[m]))
        return self._asked[key]

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        n = self._problem.num_layers
        return ((k, i, m) for k in range(n) for i in range(k + 1, n + 1)
                for m in range(len(self._shapes)))

    def __len__(self) -> int:
        return self._len


def _flatten(options: dict[tuple[int, int, int], tuple[StageOption, ...]], num_layers: int,
             num_shapes: int) -> dict[str, np.ndarray]:
    """Every option as a row: latency, state, activation bytes, flat triple index, position."""
    rows = [(o.latency, o.state_bytes, o.activation_bytes,
             triple_index(k, i, m, num_layers, num_shapes), pos)
            for (k, i, m), opts in options.items() for pos, o in enumerate(opts)]
    cols = np.array(rows, dtype=np.float64).reshape(-1, 5).T
    return {"latency": cols[0], "state": cols[1], "activation": cols[2],
            "triple": cols[3].astype(np.int64), "position": cols[4].astype(np.int64)}


def _best_fitting(flat: dict[str, np.ndarray], order: np.ndarray, counts: list[int],
                  device_memory: float | None, shape: tuple[int, int, int]
                  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per count of ``counts`` and per triple, the fastest option fitting memory with that
    many micro-batches in flight: ``{count: (latency, choice)}``.

    ``order`` sorts the options by triple, then latency (stable), so the first fitting option of
    each triple is its fastest. An option's need grows with the count (activations are never
    negative), so it fits the counts up to some index (`_last_fitting`); down a triple's
    sorted options, one is the fastest fitting for the counts above every earlier option's
    last and up to its own. All counts at once: a DP of 64 buckets asked 64 passes over a
    Llama-70B's 1.8 million options (1 s).
    """
    counts = sorted(set(counts))
    last = _last_fitting(flat, order, counts, device_memory)
    triples = flat["triple"][order]
    first = np.ones(triples.shape, bool)
    first[1:] = triples[1:] != triples[:-1]
    segment = np.cumsum(first) - 1
    # The largest "last" so far within each triple: offsetting each triple by more than the
    # range of "last" (-1 .. len(counts) - 1) lets one running maximum restart per triple.
    span = len(counts) + 2
    running = np.maximum.accumulate(segment * span + last) - segment * span
    before = np.where(first, -1, np.roll(running, 1))
    record = np.flatnonzero(last > before)   # fastest fitting for counts (before, last]
    spans = last[record] - before[record]
    rows = np.repeat(record, spans)
    count_index = np.repeat(before[record] + 1 - np.cumsum(spans) + spans, spans) + \
        np.arange(rows.size)
    cells = flat["triple"][order[rows]]
    latency = np.full((len(counts), math.prod(shape)), np.inf)
    choice = np.full((len(counts), math.prod(shape)), -1, dtype=np.int64)
    latency[count_index, cells] = flat["latency"][order[rows]]
    choice[count_index, cells] = flat["position"][order[rows]]
    return {c: (latency[t].reshape(shape), choice[t].reshape(shape))
            for t, c in enumerate(counts)}


def _last_fitting(flat: dict[str, np.ndarray], order: np.ndarray, counts: list[int],
                  device_memory: float | None) -> np.ndarray:
    """Per option in ``order``, the index of the largest of the sorted ``counts`` with which it
    fits ``device_memory`` (-1: none), by bisection on the same float operations as
    `StageOption.memory_bytes`, so the fit test agrees bit for bit."""
    if device_memory is None:
        return np.full(order.size, len(counts) - 1, dtype=np.int64)
    state, activation = flat["state"][order], flat["activation"][order]
    values = np.array(counts, dtype=np.int64)
    lo = np.full(order.size, -1, dtype=np.int64)      # fits at lo (or lo == -1)
    hi = np.full(order.size, len(counts), dtype=np.int64)   # fails at hi (or hi == len)
    while True:
        open_ = np.flatnonzero(hi - lo > 1)
        if open_.size == 0:
            return lo
        mid = (lo[open_] + hi[open_]) // 2
        fits = state[open_] + activation[open_] * values[mid] <= device_memory
        lo[open_[fits]] = mid[fits]
        hi[open_[~fits]] = mid[~fits]


def build_tables(problem: PipelineProblem) -> StageTables:
    """Profile every triple once and build the per-bucket tables (see module docstring)."""
    shapes = submesh_shapes(problem.cluster)
    if problem.kinds is not None:
        shapes = problem.kinds.shapes(shapes)
    counts = resolve_in_flight_counts(problem)
    shape = (problem.num_layers, problem.num_layers + 1, len(shapes))
    options: Mapping[tuple[int, int, int], tuple[StageOption, ...]]
    if problem.table is not None:
        t = problem.table(shapes)
        options = _AskedOnUse(problem, shapes)
        flat = {"latency": t.latency, "state": t.state, "activation": t.activation,
                "triple": t.triple, "position": t.position}
    else:
        options = profile_all(problem, shapes)
        flat = _flatten(options, problem.num_layers, len(shapes))
    order = np.lexsort((flat["latency"], flat["triple"]))
    by_count = _best_fitting(flat, order, list(counts[1:]), problem.device_memory, shape)
    rows = _bucket_rows([by_count[c] for c in counts[1:]])
    mask, discount, inside = None if problem.kinds is None else problem.kinds.mask(shapes), \
        None, None
    if problem.links is not None:
        mask, discount, inside = link_arrays(problem, shapes)
    return StageTables(
        shapes=shapes, sizes=np.array([s[0] * s[1] for s in shapes], dtype=np.int64),
        counts=counts, options=options, flat=flat,
        latency=np.stack([latency for latency, _ in rows]),
        choice=np.stack([choice for _, choice in rows]),
        mask=mask, discount=discount, inside=inside)


def link_arrays(problem: PipelineProblem, shapes: tuple[Submesh, ...]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For `Links`: ``mask[m, d]`` 0 where a stage of ``shapes[m]`` is placeable starting with
    ``d`` devices left (position N - d), inf elsewhere; ``discount[k, m]``; ``inside[d]``."""
    assert problem.links is not None
    total, per_host = problem.cluster.num_devices, problem.cluster.devices_per_host
    mask = np.full((len(shapes), total + 1), np.inf)
    for m, shape in enumerate(shapes):
        for d in range(shape[0] * shape[1], total + 1):
            if placeable(shape, total - d, per_host):
                mask[m, d] = 0.0
    discount = np.array([[problem.links.discount(k, shape) if k else 0.0 for shape in shapes]
                         for k in range(problem.num_layers)], dtype=np.float64)
    if np.any(discount < 0) or not np.all(np.isfinite(discount)):
        raise ValueError("Links.discount must be finite and >= 0")
    inside = np.array([d < total and inside_host(total - d, per_host)
                       for d in range(total + 1)])
    return mask, discount, inside


def _bucket_rows(rows: list[tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, ...]]:
    """``rows`` (one per r = 1..S_max) without the trailing rows equal to the one before."""
    num_buckets = len(rows)
    while num_buckets > 1 and all(
            np.array_equal(a, b) for a, b in zip(rows[num_buckets - 1], rows[num_buckets - 2])):
        num_buckets -= 1
    return rows[:num_buckets]


def memory_need(tables: StageTables) -> np.ndarray:
    """Per bucket and triple, ``min_o state_bytes + activation_bytes * counts[r]`` (inf if none).

    Shape ``(R', L, L + 1, num_shapes)`` with its own bucket count ``R'`` (the rows differ with
    the count even when memory is unlimited).
    """
    flat, shape = tables.flat, tables.latency.shape[1:]
    by_count = {}
    for count in set(tables.counts[1:]):
        need = np.full(shape, np.inf)
        np.minimum.at(need.reshape(-1), flat["triple"], flat["state"] + flat["activation"] * count)
        by_count[count] = (need,)
    return np.stack([need for (need,) in _bucket_rows([by_count[c] for c in tables.counts[1:]])])


# What a sweep with `Links` adds (`sweep`): ``(inside_cost, discount, inside)``, where
# ``inside_cost`` is ``cost`` for stages whose inbound boundary is inside a host (filtered by
# their discounted latency), ``discount[k, m]`` and ``inside[d]`` as `StageTables` has them.
LinkCosts = tuple[np.ndarray, np.ndarray, np.ndarray]


def sweep(cost: np.ndarray, sizes: np.ndarray, num_devices: int,
          combine: np.ufunc = np.add, mask: np.ndarray | None = None,
          links: LinkCosts | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One backward pass of the recurrence over buckets, layers and device counts (``mask``:
    the typed or placeable submeshes' positions, module docstring). With ``links`` a stage
    starting with ``d`` devices left where ``inside[d]`` costs its ``inside_cost`` entry less
    its discount instead of its ``cost`` entry (latencies only: ``combine`` is ``+``).

    ``cost``: ``(R, L, L + 1, num_shapes)``, inf where a stage is not allowed. Returns ``F`` of
    shape ``(R + 1, L + 1, D + 1)`` and ``P`` of shape ``(R, L + 1, pad + D + 1)`` (``P_r`` padded
    on the left with ``pad = max(sizes)`` infinities so ``d - n_m < 0`` reads inf).
    """
    num_buckets, num_layers = cost.shape[0], cost.shape[1]
    pad = int(sizes.max())
    f = np.full((num_buckets + 1, num_layers + 1, num_devices + 1), np.inf)
    p = np.full((num_buckets, num_layers + 1, pad + num_devices + 1), np.inf)
    f[0, num_layers, 0] = 0.0
    _fill_successor(f, p, num_layers, pad)
    allowed = np.isfinite(cost).any(axis=0)  # (k, i, m) some bucket may use
    if links is not None:
        assert combine is np.add, "links price latencies"
        allowed |= np.isfinite(links[0]).any(axis=0)
    across = None if links is None else _across(links[2], sizes)
    reachable = np.zeros(num_layers + 1, bool)  # layer i can still reach the end
    reachable[num_layers] = True
    for k in range(num_layers - 1, -1, -1):
        live = min(num_buckets, num_layers - k)  # r stages need r layers: higher buckets stay inf
        best = _best_next_stage(cost[:live, k, k + 1:], p[:live, k + 1:], sizes, pad, combine,
                                allowed[k, k + 1:] & reachable[k + 1:, None], mask,
                                None if links is None else
                                (links[0][:live, k, k + 1:], links[1][k], links[2]), across)
        if best is not None:
            f[1:live + 1, k] = best
            _fill_successor(f, p, k, pad)
            reachable[k] = np.isfinite(p[:, k]).any()
    return f, p


def _best_next_stage(cost: np.ndarray, successor: np.ndarray, sizes: np.ndarray, pad: int,
                     combine: np.ufunc, allowed: np.ndarray, mask: np.ndarray | None = None,
                     links: LinkCosts | None = None, across: list | None = None
                     ) -> np.ndarray | None:
    """``min_{i, m} cost[r, i, m] (+) successor[r, i, pad + d - n_m]`` for every ``(r, d)``
    (with ``links``, one layer's: ``inside_cost[r, i, m]`` less ``discount[m]`` where
    ``inside[d]``; ``across[m]`` indexes the ``d >= n_m`` whose boundary is not inside).

    One slice per submesh over the span of allowed ``i`` (entries outside ``allowed`` are inf in
    ``cost``, so the span is exact) and over the ``d >= n_m`` only (fewer devices left read the
    padding's infinities): views cost no copy, and spans are nearly contiguous because longer
    ranges are slower; measured 2-4x faster than one gather over all (i, m) on 16x8. The mask
    (0 or inf per ``d``) is added after the minimum over ``i``, where it is the same sum; with
    links each ``d`` is reduced once, on the cost its boundary takes. None when no ``(i, m)``
    is allowed.
    """
    width = successor.shape[2] - pad
    result = np.full((successor.shape[0], width), np.inf)
    any_allowed = False
    for m, n_m in enumerate(sizes.tolist()):
        rows = np.flatnonzero(allowed[:, m])
        if rows.size == 0:
            continue
        any_allowed = True
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        block = successor[:, lo:hi, pad:pad + width - n_m]   # d = n_m .. width - 1
        if links is None:
            vals = combine(cost[:, lo:hi, m, None], block).min(axis=1)
        else:
            assert across is not None
            inside_cost, discount, _ = links
            vals = (inside_cost[:, lo:hi, m, None] + block).min(axis=1) - discount[m]
            vals[:, across[m]] = combine(cost[:, lo:hi, m, None],
                                         block[:, :, across[m]]).min(axis=1)
        if mask is not None:
            vals += mask[m, n_m:]
        np.minimum(result[:, n_m:], vals, out=result[:, n_m:])
    return result if any_allowed else None


def _across(inside: np.ndarray, sizes: np.ndarray) -> list:
    """Per submesh size ``n``, the ``d - n`` (``d >= n``) of the devices-left counts whose
    stage boundary is not inside a host: a slice where they are evenly spaced (a view, not a
    gather), else an index array."""
    out: list = []
    for n in sizes.tolist():
        idx = np.flatnonzero(~inside[n:])
        steps = np.unique(np.diff(idx))
        out.append(slice(int(idx[0]), int(idx[-1]) + 1, int(steps[0]))
                   if idx.size > 1 and steps.size == 1 else idx)
    return out


def _fill_successor(f: np.ndarray, p: np.ndarray, k: int, pad: int) -> None:
    """Set ``P_r(k, .)`` from ``F(., k, .)``: ``F(r-1)`` and, for the last bucket, the min."""
    num_buckets = p.shape[0]
    p[:, k, pad:] = f[:num_buckets, k]
    p[-1, k, pad:] = np.minimum(f[num_buckets - 1, k], f[num_buckets, k])


def backtrack(cost: np.ndarray, f: np.ndarray, p: np.ndarray, sizes: np.ndarray,
              combine: np.ufunc = np.add, mask: np.ndarray | None = None,
              links: LinkCosts | None = None) -> list[tuple[int, int, int, int]] | None:
    """The stages ``(start, end, shape index, bucket)`` of an optimal ``F`` path, or None.

    Recomputes each step's candidates with the same float operations as `sweep`, so the argmin
    reproduces the table's value exactly.
    """
    num_buckets, num_layers, num_devices = cost.shape[0], cost.shape[1], f.shape[2] - 1
    pad = p.shape[2] - num_devices - 1
    r = 1 + int(np.argmin(f[1:, 0, num_devices]))
    if not np.isfinite(f[r, 0, num_devices]):
        return None
    stages, k, d = [], 0, num_devices
    while r > 0:
        ends = np.arange(k + 1, num_layers + 1)
        succ = p[r - 1][ends[:, None], pad + d - sizes[None, :]]
        if mask is not None:
            succ = succ + mask[:, d][None, :]
        if links is not None and links[2][d]:
            vals = (links[0][r - 1, k, k + 1:, :] + succ) - links[1][k][None, :]
        else:
            vals = combine(cost[r - 1, k, k + 1:, :], succ)
        i_off, m = np.unravel_index(int(np.argmin(vals)), vals.shape)
        i, m = k + 1 + int(i_off), int(m)
        stages.append((k, i, m, r))
        k, d = i, d - int(sizes[m])
        if r == num_buckets and f[r - 1, k, d] > f[r, k, d]:
            continue  # still "R or more stages left"
        r -= 1
    assert k == num_layers and d == 0, (k, d)
    return stages
