"""Build the linearized MILP (Alpa eq. 1) from a reduced problem, in bulk numpy arrays.

Columns: one binary ``s[g, p]`` per free group and allowed strategy, then continuous edge
variables, then (memory objective only) one continuous ``M``. Rows, each family built by one
function (the math is in ``meshplan.planner.intra.ilp``'s docstring):

- ``build_choice_rows``: one-hot, ``sum_p s[g, p] = 1``;
- ``build_edge_rows``: marginal form (default) or the 3-inequality McCormick form (kept only to
  measure against). Strategies whose matrix rows (columns) are identical share a *class*, and edge
  variables exist per finite class pair, which is exact and often much smaller;
- ``build_memory_rows``: ``sum_{v in L} sum_p mem[v, p] s[v, p] + W <= budget`` per live set
  ``L`` (or ``<= M`` when minimizing memory), where the continuous ``W >= sum_p work[g, p]
  s[g, p]`` for every group bounds the largest working set chosen (held only while a pass runs,
  by one node at a time: a maximum, not a sum); rows that can never bind are skipped;
- ``build_shared_rows``: one continuous ``y`` per shared (fan-out) cost, paid when any of its
  blocks holds. A block "a in P and some b_i in Q_i" (a value moved once for its consumers):
  ``y >= sum e_ab_i[P, Q_i]`` per i over pair indicators ``e`` (marginal rows as an edge's);
  another: ``y >= sum_{clause in block} [clause] - (|block| - 1)``, where a clause's indicator
  is ``sum_{p in P} s[g, p]`` for one condition ``(g, P)`` and a continuous ``z >= sum_{p in
  P_i} s[g_i, p]`` (for each of its conditions i) for several;
- ``build_overlap_rows``: per overlap term one continuous ``o >= 0`` with cost ``-weight``
  and ``o <= sum hidden[g, p] s[g, p]``, ``o <= sum window[g, p] s[g, p]``: at the optimum
  ``o`` is the smaller sum, the seconds the term saves; in order, also ``o <= d_k`` per
  node with hidden seconds, the ``d_k`` continuous and chained (`_build_in_order_rows`);
- ``build_max_cost_row``: ``c^T x + offset <= max_cost``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp_reduce import ReducedIlp

EDGE_FORMS = ("marginal", "mccormick")
# Shared costs: "pairs" (pair indicators where a block allows, `build_shared_rows`) or
# "clauses" (every block as ``y >= sum [clause] - (|block| - 1)``, kept to measure against).
SHARED_FORMS = ("pairs", "clauses")


@dataclass(frozen=True)
class MemorySpec:
    """Memory data for the model: per-node bytes per strategy and the live sets.

    ``budget`` in bytes caps every live set; None means "minimize the largest live set" instead.
    ``node_working``: per-node bytes per strategy held only while a pass runs; the largest one
    chosen adds to every live set (None: none).
    """

    node_memory: tuple[np.ndarray, ...]
    live_sets: tuple[tuple[int, ...], ...]
    budget: float | None
    node_working: tuple[np.ndarray, ...] | None = None


@dataclass(frozen=True, eq=False)
class MilpModel:
    """``min cost^T x + offset`` s.t. ``row_lower <= A x <= row_upper``, ``0 <= x <= upper``.

    ``A`` is given as COO triplets ``(rows, cols, vals)``; ``integral[j]`` marks binaries.
    ``choice_cols[g]`` is the first column of free group ``g``'s ``s`` block (-1 when fixed).
    ``num_coupling_rows`` counts memory and max-cost rows: without them only one-hot and
    marginal rows remain, whose LP relaxation is often (on trees always) integral.
    """

    cost: np.ndarray
    offset: float
    upper: np.ndarray
    integral: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    choice_cols: np.ndarray
    num_coupling_rows: int

    @property
    def num_cols(self) -> int:
        """Number of variables."""
        return int(self.cost.size)

    @property
    def num_rows(self) -> int:
        """Number of constraints."""
        return int(self.row_lower.size)


class _Coo:
    """Accumulates columns, rows and nonzeros while one model is being built."""

    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integral: list[np.ndarray] = []
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.lower_rows: list[np.ndarray] = []
        self.upper_rows: list[np.ndarray] = []
        self.num_cols = 0
        self.num_rows = 0
        self.num_coupling_rows = 0

    def add_cols(self, cost: np.ndarray, upper: float, integral: bool) -> int:
        self.cost.append(np.asarray(cost, dtype=np.float64))
        self.upper.append(np.full(cost.size, upper))
        self.integral.append(np.full(cost.size, integral))
        self.num_cols += cost.size
        return self.num_cols - cost.size

    def add_rows(self, lower: np.ndarray | float, upper: np.ndarray | float, count: int) -> int:
        self.lower_rows.append(_spread(lower, count))
        self.upper_rows.append(_spread(upper, count))
        self.num_rows += count
        return self.num_rows - count

    def add_entries(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        self.entries.append((rows, np.asarray(cols, dtype=np.int64), _spread(vals, rows.size)))

    def finish(self, offset: float, choice_cols: np.ndarray) -> MilpModel:
        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        rows, cols, vals = (cat([e[i] for e in self.entries], t)
                            for i, t in ((0, np.int64), (1, np.int64), (2, np.float64)))
        return MilpModel(cat(self.cost, np.float64), offset, cat(self.upper, np.float64),
                         cat(self.integral, np.bool_), rows, cols, vals,
                         cat(self.lower_rows, np.float64), cat(self.upper_rows, np.float64),
                         choice_cols, self.num_coupling_rows)


def _spread(value: np.ndarray | float, count: int) -> np.ndarray:
    """``value`` as ``count`` float64s: a scalar repeated (np.full is several times cheaper
    than np.broadcast_to, and model building calls this a hundred thousand times)."""
    if isinstance(value, (int, float)):
        return np.full(count, value, dtype=np.float64)
    return np.broadcast_to(np.asarray(value, dtype=np.float64), (count,))


# An overlap term for the model: (hidden, window) per node (arrays by strategy), weight, in
# order (`OverlapTerm.in_order`) each node's ready point (else None), and its gated hidden
# seconds (node, gate node, gate strategies, seconds by strategy).
Gate = tuple[int, int, tuple[int, ...], np.ndarray]
OverlapSpec = tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], float,
                    tuple[int, ...] | None, tuple[Gate, ...]]


def build_model(reduced: ReducedIlp, *, memory: MemorySpec | None = None,
                max_cost: float | None = None, edge_form: str = "marginal",
                shared_form: str = "pairs", overlap: tuple[OverlapSpec, ...] = ()
                ) -> MilpModel:
    """Build the MILP of a reduced problem; see the module docstring for the layout.

    With ``memory.budget is None`` the objective becomes the memory bound ``M`` (node and edge
    costs are then expected to be 0/inf masks). Raises InfeasibleIlpError when a constraint
    without variables is violated, ValueError for an unknown ``edge_form``.
    """
    if edge_form not in EDGE_FORMS:
        raise ValueError(f"edge_form {edge_form!r} is not one of {EDGE_FORMS}")
    if shared_form not in SHARED_FORMS:
        raise ValueError(f"shared_form {shared_form!r} is not one of {SHARED_FORMS}")
    coo = _Coo()
    choice_cols, offset = build_choice_rows(coo, reduced)
    build_edge_rows(coo, reduced, choice_cols, edge_form)
    build_shared_rows(coo, reduced, choice_cols, pairs=shared_form == "pairs")
    offset += reduced.shared_offset
    if memory is not None:
        build_memory_rows(coo, reduced, choice_cols, memory)
    for term in overlap:
        build_overlap_rows(coo, reduced, choice_cols, term)
    if max_cost is not None:
        build_max_cost_row(coo, max_cost - offset)
    return coo.finish(offset, choice_cols)


def build_choice_rows(coo: _Coo, reduced: ReducedIlp) -> tuple[np.ndarray, float]:
    """Add the ``s`` binaries and one-hot rows; return (first column per group, fixed offset)."""
    choice_cols = np.full(len(reduced.costs), -1, dtype=np.int64)
    offset = 0.0
    for g, cost in enumerate(reduced.costs):
        allowed = reduced.allowed(g)
        if allowed.size == 1:
            offset += float(cost[allowed[0]])
            continue
        start = coo.add_cols(cost[allowed], 1.0, True)
        row = coo.add_rows(1.0, 1.0, 1)
        coo.add_entries(np.full(allowed.size, row), start + np.arange(allowed.size), 1.0)
        choice_cols[g] = start
    return choice_cols, offset


def build_edge_rows(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                    edge_form: str) -> None:
    """Add the variables and rows that linearize ``s_u^T R s_v`` for every remaining edge."""
    for gu, gv, r in reduced.edges:
        allowed_u, allowed_v = reduced.allowed(gu), reduced.allowed(gv)
        block = r[np.ix_(allowed_u, allowed_v)]
        row_first, row_class = edge_classes(block)
        col_first, col_class = edge_classes(block.T)
        classes = block[np.ix_(row_first, col_first)]
        s_u = choice_cols[gu] + np.arange(allowed_u.size)
        s_v = choice_cols[gv] + np.arange(allowed_v.size)
        build = _marginal_rows if edge_form == "marginal" else _mccormick_rows
        build(coo, classes, (row_class, s_u), (col_class, s_v))


def build_shared_rows(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                      pairs: bool = True) -> None:
    """One ``y`` column per shared cost and rows per block (see the module docstring).

    A block "node a picks a strategy in P, and some node b_i picks one in Q_i" (a value moved
    once for every consumer wanting one layout) gets, per condition i, ``y >= sum of e_ab[P,
    Q_i]`` over a pair indicator of (a, b_i) (`_PairIndicators`): exact once ``s`` is
    integral, and its LP relaxation is far tighter than ``y >= [P] + [Q] - 1``, which lets a
    half-chosen producer and a half-chosen consumer pay nothing (measured: a 9-layer Llama
    stage on a 2x4 mesh, 27 s -> under a second). Other blocks: a clause of one condition
    enters the row as its ``s`` columns; a clause of several is one continuous ``z >= sum_{p
    in P} s[g, p]`` per condition, built once per distinct clause. With a positive cost the
    minimum puts ``y`` and ``z`` at their largest indicator, 0 or 1 once ``s`` is integral, so
    the terms are exact; the rows count as coupling rows because the LP relaxation may be
    fractional.
    """
    clause_cols: dict[tuple, int] = {}
    indicators = _PairIndicators(reduced, choice_cols)
    terms = [[_pair_terms(block, choice_cols) if pairs else [] for block in blocks]
             for _, blocks in reduced.shared]
    for block_terms in terms:
        for a, b, p_set, q_set in (t for ts in block_terms for t in ts):
            indicators.want(a, b, p_set, q_set)
    indicators.build(coo)
    for (cost, blocks), block_terms in zip(reduced.shared, terms):
        y = coo.add_cols(np.array([cost]), 1.0, False)
        for block, pair_terms in zip(blocks, block_terms):
            if pair_terms:
                for a, b, p_set, q_set in pair_terms:
                    cells = indicators.cells(a, b, p_set, q_set)
                    row = coo.add_rows(-np.inf, 0.0, 1)
                    coo.add_entries(np.full(cells.size + 1, row), np.append(cells, y),
                                    np.append(np.ones(cells.size), -1.0))
                    coo.num_coupling_rows += 1
                continue
            cols, vals = [np.array([y])], [np.array([-1.0])]
            for clause in block:
                if len(clause) == 1:
                    g, pos = clause[0]
                    cols.append(choice_cols[g] + pos)
                else:
                    cols.append(np.array([_clause_col(coo, clause, choice_cols, clause_cols)]))
                vals.append(np.ones(cols[-1].size))
            row = coo.add_rows(-np.inf, float(len(block) - 1), 1)
            flat = np.concatenate(cols)
            coo.add_entries(np.full(flat.size, row), flat, np.concatenate(vals))
            coo.num_coupling_rows += 1


def _pair_terms(block: tuple, choice_cols: np.ndarray
                ) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """A block of two clauses, one a single condition (a, P), as (a, b_i, P, Q_i) per
    condition (b_i, Q_i) of the other; empty for any other block (or one naming a fixed
    group, or a twice)."""
    if len(block) != 2:
        return []
    single, other = (block[0], block[1]) if len(block[0]) == 1 else (block[1], block[0])
    if len(single) != 1:
        return []
    a, p_pos = single[0]
    if choice_cols[a] < 0 or any(g == a or choice_cols[g] < 0 for g, _ in other):
        return []
    p_set = tuple(int(x) for x in p_pos)
    return [(a, g, p_set, tuple(int(x) for x in q_pos)) for g, q_pos in other]


class _PairIndicators:
    """For pairs of groups (a, b), continuous ``e[A, B]`` over classes of their strategies
    with the marginal rows ``sum_B e[A, B] = sum_{p in A} s_a[p]`` (and for B): the joint
    choice of a and b, as an edge has it. A class holds the strategies that belong to the
    same sets among those asked for (`want`), so every set asked is a union of classes."""

    def __init__(self, reduced: ReducedIlp, choice_cols: np.ndarray) -> None:
        self.reduced, self.choice_cols = reduced, choice_cols
        self.sets: dict[tuple[int, int], tuple[dict, dict]] = {}
        self.built: dict[tuple[int, int], tuple] = {}

    def want(self, a: int, b: int, p_set: tuple[int, ...], q_set: tuple[int, ...]) -> None:
        side_a, side_b = self.sets.setdefault((a, b), ({}, {}))
        side_a.setdefault(p_set, len(side_a))
        side_b.setdefault(q_set, len(side_b))

    def build(self, coo: _Coo) -> None:
        for (a, b), (sets_a, sets_b) in self.sets.items():
            class_a, class_b = self._classes(a, sets_a), self._classes(b, sets_b)
            n_a, n_b = int(class_a.max()) + 1, int(class_b.max()) + 1
            e = coo.add_cols(np.zeros(n_a * n_b), 1.0, False)   # e[i, j] at e + i * n_b + j
            grid = e + np.arange(n_a * n_b).reshape(n_a, n_b)
            for classes, cells, g in ((class_a, grid, a), (class_b, grid.T, b)):
                base = coo.add_rows(0.0, 0.0, cells.shape[0])
                coo.add_entries(np.repeat(base + np.arange(cells.shape[0]), cells.shape[1]),
                                cells.ravel(), 1.0)
                coo.add_entries(base + classes, self.choice_cols[g] + np.arange(classes.size),
                                -1.0)
            self.built[(a, b)] = (grid, class_a, class_b)

    def _classes(self, g: int, sets: dict) -> np.ndarray:
        """Class of each allowed strategy of ``g``: by membership in each set asked for."""
        member = np.zeros((self.reduced.allowed(g).size, len(sets)), dtype=bool)
        for pos, k in sets.items():
            member[list(pos), k] = True
        return np.unique(member, axis=0, return_inverse=True)[1].ravel()

    def cells(self, a: int, b: int, p_set: tuple[int, ...], q_set: tuple[int, ...]
              ) -> np.ndarray:
        """The ``e`` columns of the cells with a's class in P and b's in Q."""
        grid, class_a, class_b = self.built[(a, b)]
        rows = np.unique(class_a[list(p_set)])
        cols = np.unique(class_b[list(q_set)])
        return grid[np.ix_(rows, cols)].ravel()


def _clause_col(coo: _Coo, clause: tuple, choice_cols: np.ndarray,
                cache: dict[tuple, int]) -> int:
    """The ``z`` column of a clause of several conditions (one per distinct clause)."""
    key = tuple(sorted((g, tuple(int(p) for p in pos)) for g, pos in clause))
    if key not in cache:
        z = coo.add_cols(np.zeros(1), 1.0, False)
        for g, pos in clause:
            row = coo.add_rows(-np.inf, 0.0, 1)
            coo.add_entries(np.full(pos.size + 1, row),
                            np.concatenate([choice_cols[g] + pos, [z]]),
                            np.concatenate([np.ones(pos.size), [-1.0]]))
            coo.num_coupling_rows += 1
        cache[key] = z
    return cache[key]


def edge_classes(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group identical rows: (first row of each class, class of each row).

    Strategies that emit the same sharding spec have identical rows, so one edge variable per
    class pair is exact and often several times smaller than one per strategy pair.
    """
    rows = np.ascontiguousarray(block, dtype=np.float64) + 0.0   # -0.0 -> 0.0
    if rows.shape[1] == 0:
        return np.zeros(min(1, rows.shape[0]), dtype=np.intp), np.zeros(rows.shape[0], np.intp)
    # Rows as single byte strings: a 1-D unique is several times faster than ``axis=0``, then
    # the classes are put in the rows' lexicographic order, as ``np.unique(axis=0)`` has them.
    void = rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).ravel()
    _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
    order = np.lexsort(rows[first].T[::-1])
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return first[order], rank[inverse.ravel()]


def _marginal_rows(coo: _Coo, classes: np.ndarray, side_u: tuple[np.ndarray, np.ndarray],
                   side_v: tuple[np.ndarray, np.ndarray]) -> None:
    """``sum_Q e[P, Q] = sum_{p in P} s_u[p]`` per row class, and the same per column class."""
    pair_p, pair_q = np.nonzero(np.isfinite(classes))
    e = coo.add_cols(classes[pair_p, pair_q], 1.0, False) + np.arange(pair_p.size)
    for pair_class, (class_of, s_cols), count in ((pair_p, side_u, classes.shape[0]),
                                                  (pair_q, side_v, classes.shape[1])):
        base = coo.add_rows(0.0, 0.0, count)
        coo.add_entries(base + pair_class, e, 1.0)
        coo.add_entries(base + class_of, s_cols, -1.0)


def _mccormick_rows(coo: _Coo, classes: np.ndarray, side_u: tuple[np.ndarray, np.ndarray],
                    side_v: tuple[np.ndarray, np.ndarray]) -> None:
    """``e <= S_P``, ``e <= S_Q``, ``S_P + S_Q - e <= 1`` per finite pair; ``S_P + S_Q <= 1``
    per forbidden pair, where ``S_P`` sums the ``s`` of class ``P``."""
    finite = np.isfinite(classes)
    pair_p, pair_q = np.nonzero(finite)
    e = coo.add_cols(classes[pair_p, pair_q], 1.0, False) + np.arange(pair_p.size)
    for sign_u, sign_v, sign_e, upper in ((-1, 0, 1, 0.0), (0, -1, 1, 0.0), (1, 1, -1, 1.0)):
        base = coo.add_rows(-np.inf, upper, pair_p.size)
        _add_class_sums(coo, base, pair_p, side_u, sign_u)
        _add_class_sums(coo, base, pair_q, side_v, sign_v)
        coo.add_entries(base + np.arange(pair_p.size), e, float(sign_e))
    bad_p, bad_q = np.nonzero(~finite)
    base = coo.add_rows(-np.inf, 1.0, bad_p.size)
    _add_class_sums(coo, base, bad_p, side_u, 1)
    _add_class_sums(coo, base, bad_q, side_v, 1)


def _add_class_sums(coo: _Coo, base: int, wanted: np.ndarray,
                    side: tuple[np.ndarray, np.ndarray], sign: int) -> None:
    """Row ``base + k`` gets ``sign * s`` for every strategy in class ``wanted[k]``."""
    if sign == 0 or wanted.size == 0:
        return
    class_of, s_cols = side
    order = np.argsort(class_of, kind="stable")
    sizes = np.bincount(class_of)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    counts = sizes[wanted]
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    members = order[np.repeat(starts[wanted], counts) + within]
    coo.add_entries(base + np.repeat(np.arange(wanted.size), counts), s_cols[members],
                    float(sign))


def build_memory_rows(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                      memory: MemorySpec) -> None:
    """Add one row per distinct live set that can bind (or every row when minimizing ``M``).

    Raises InfeasibleIlpError when a live set exceeds the budget under every assignment.
    """
    m_col = -1 if memory.budget is not None else coo.add_cols(np.ones(1), np.inf, False)
    unit = max([1.0] + [float(np.abs(m).max()) for m in memory.node_memory if m.size])
    w_col, w_least, w_most = _working_column(coo, reduced, choice_cols, memory, unit)
    for live in dict.fromkeys(frozenset(s) for s in memory.live_sets):
        const, cols, coefs = _live_set_terms(live, reduced, choice_cols, memory)
        if w_col >= 0:
            cols, coefs = cols + [np.array([w_col])], coefs + [np.array([unit])]
        else:
            const += w_least
        if m_col >= 0:
            # M counts in units of the largest memory coefficient (one unit for every row): it
            # then enters each scaled row with a coefficient near 1, not 1/bytes, which a
            # solver would read as zero.
            _add_row(coo, cols + [np.array([m_col])], coefs + [np.array([-unit])], -const)
            continue
        choices = coefs[:-1] if w_col >= 0 else coefs
        least = const + sum(float(c.min()) for c in choices) + (w_least if w_col >= 0 else 0.0)
        if least > memory.budget * (1 + 1e-12):
            raise InfeasibleIlpError(f"live set {sorted(live)} needs at least {least:.6g} "
                                     f"bytes > budget {memory.budget:.6g}")
        most = const + sum(float(c.max()) for c in choices) + (w_most if w_col >= 0 else 0.0)
        if most > memory.budget:
            _add_row(coo, cols, coefs, memory.budget - const)


def _working_column(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                    memory: MemorySpec, unit: float) -> tuple[int, float, float]:
    """The column ``W`` (in units of ``unit`` bytes, like ``M``) bounding the chosen working
    sets, with its rows; -1 when no free group has one. Also the least and the most bytes it
    can stand for: the fixed groups' largest, and the largest of all."""
    if memory.node_working is None:
        return -1, 0.0, 0.0
    per_group: dict[int, np.ndarray] = {}
    for v, work in enumerate(memory.node_working):
        if work.size and work.max() > 0:
            g = int(reduced.group_of_node[v])
            per_group[g] = np.maximum(per_group.get(g, 0.0), work)
    fixed, free = 0.0, []
    for g, work in per_group.items():
        allowed = reduced.allowed(g)
        if choice_cols[g] < 0:
            fixed = max(fixed, float(work[allowed[0]]))
        elif work[allowed].max() > 0:
            free.append((g, work[allowed]))
    if not free:
        return -1, fixed, fixed
    w_col = coo.add_cols(np.zeros(1), np.inf, False)
    for g, work in free:   # W >= the group's chosen working set
        _add_row(coo, [choice_cols[g] + np.arange(work.size), np.array([w_col])],
                 [work, np.array([-unit])], 0.0)
    if fixed > 0:
        _add_row(coo, [np.array([w_col])], [np.array([-unit])], -fixed)
    return w_col, fixed, max(fixed, max(float(w.max()) for _, w in free))


def _live_set_terms(live: frozenset[int], reduced: ReducedIlp, choice_cols: np.ndarray,
                    memory: MemorySpec) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
    """Bytes of fixed groups, then per free group its columns and their bytes."""
    return _group_terms(live, reduced, choice_cols, memory.node_memory)


def build_overlap_rows(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                       term: OverlapSpec) -> None:
    """The saving column of one overlap term and its two bounds (module docstring); nothing
    when the term cannot save anything."""
    hidden, window, weight, ready, gated = term
    bounds = [_group_terms(range(len(hidden)), reduced, choice_cols, per_node)
              for per_node in (hidden, window)]
    gated = tuple(gate for gate in gated if gate[3].size and float(gate[3].max()) > 0)
    if weight <= 0 or any(const <= 0 and not any(c.max() > 0 for c in coefs)
                          and (k or not gated) for k, (const, _, coefs) in enumerate(bounds)):
        return
    # The saving and the gated seconds are columns in units of the term's largest entry, not
    # in seconds: a column in seconds next to the in-order chain's columns in those units
    # left coefficients from 2e-9 to 110 in one model, and HiGHS's dual simplex then crawled
    # through the root's cut rounds (Gemma 2 9B, one layer on 2x8 devices as 4x4: over 60 s
    # at the root without a first point; 1.9 s to the optimum in these units).
    unit = max([float(m.max()) for m in (*hidden, *window) if m.size]
               + [float(gate[3].max()) for gate in gated], default=0.0)
    if unit <= 0:
        return
    o_col = coo.add_cols(np.array([-weight * unit]), np.inf, False)
    z = _build_gate_cols(coo, reduced, choice_cols, gated, unit)
    for k, (const, cols, coefs) in enumerate(bounds):   # o - sum coefs x (- sum z) <= const
        extra = [] if k else [np.array(z, dtype=np.int64)]
        _add_row(coo, cols + extra + [np.array([o_col])],
                 [-c / unit for c in coefs] + [-np.ones(len(e)) for e in extra]
                 + [np.ones(1)], const / unit)
    if ready is not None:
        _build_in_order_rows(coo, reduced, choice_cols, hidden, window, ready, o_col, unit,
                             [(gate[0], col) for gate, col in zip(gated, z)])


def _build_gate_cols(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                     gated: tuple[Gate, ...], unit: float) -> list[int]:
    """Per gated entry a continuous ``z`` (in ``unit`` seconds), which the saving's rows take
    for the seconds: at most its node's seconds under the node's strategy while the gate node
    picks none of the gate strategies, over pair indicators of the two nodes' joint choice
    (`_PairIndicators`: ``z <= sum_p seconds[p] e[open, p]``). The bound by marginals alone, ``z
    <= seconds(s_v)`` and ``z <= M (1 - sum of the gate's columns)``, let a half-ZeRO parameter
    open half of its consumer's largest seconds whatever the consumer's mix, and HiGHS then
    proved a Wide-ResNet's plan (16 V100, every weight's update free to be ZeRO's) in 26 s where
    it found it in 5. Where either node is fixed, or both are one group, the marginal bound
    stays (exact at an integral point, as the joint one)."""
    pairs = _PairIndicators(reduced, choice_cols)
    # Per entry its nodes' groups, and where the joint bound applies the gate's open positions
    # and the node's positions by their seconds (> 0).
    joint: list[tuple[int, int, tuple[int, ...], list] | None] = []
    for v, g, strategies, seconds in gated:
        gv, gg = int(reduced.group_of_node[v]), int(reduced.group_of_node[g])
        if choice_cols[gv] < 0 or choice_cols[gg] < 0 or gv == gg:
            joint.append(None)
            continue
        open_pos = tuple(k for k, s in enumerate(reduced.allowed(gg)) if int(s) not in strategies)
        values = seconds[reduced.allowed(gv)] / unit
        levels = [(float(x), tuple(int(k) for k in np.flatnonzero(values == x)))
                  for x in np.unique(values) if x > 0] if open_pos else []
        for _, pos in levels:
            pairs.want(gg, gv, open_pos, pos)
        joint.append((gg, gv, open_pos, levels))
    pairs.build(coo)
    out = []
    for (v, g, strategies, seconds), pair in zip(gated, joint):
        col = coo.add_cols(np.zeros(1), np.inf, False)
        out.append(col)
        if pair is not None:   # z <= sum_p seconds[p] e[open, p]; z <= 0 when never open
            gg, gv, open_pos, levels = pair
            cells = [pairs.cells(gg, gv, open_pos, pos) for _, pos in levels]
            _add_row(coo, [np.array([col])] + cells,
                     [np.ones(1)] + [np.full(c.size, -x) for c, (x, _) in zip(cells, levels)],
                     0.0)
            continue
        most = float(seconds.max()) / unit
        fixed, cols, coefs = _group_terms([v], reduced, choice_cols, {v: seconds / unit})
        _add_row(coo, cols + [np.array([col])], [-c for c in coefs] + [np.ones(1)], fixed)
        picks = np.zeros(len(reduced.costs[int(reduced.group_of_node[g])]))
        picks[list(strategies)] = most
        fixed, cols, coefs = _group_terms([g], reduced, choice_cols, {g: picks})
        _add_row(coo, cols + [np.array([col])], coefs + [np.ones(1)], most - fixed)
    return out


def _build_in_order_rows(coo: _Coo, reduced: ReducedIlp, choice_cols: np.ndarray,
                         hidden: tuple[np.ndarray, ...], window: tuple[np.ndarray, ...],
                         ready: tuple[int, ...], o_col: int, unit: float,
                         gate_cols: Sequence[tuple[int, int]] = ()) -> None:
    """``o <= d_k`` for the k-th ready point t_k of a node with hidden seconds, ``d_k`` the
    hidden of the nodes ready after it plus the window of those before
    (`OverlapTerm.in_order`), as a chain: ``d_1`` over every node, then ``d_{k+1} = d_k -
    hidden(ready in (t_k, t_{k+1}]) + window[t_k, t_{k+1})``, so each node's columns enter
    two rows however many bounds there are; ``gate_cols``: (node, column) of the gated
    seconds (`_build_gate_cols`), ready where their node is. In units of ``unit`` (the
    term's largest entry, as ``o`` and the gated columns are), so that the rows' absolute
    tolerance is relative to it."""
    at = sorted({ready[v] for v, h in enumerate(hidden) if h.size and float(h.max()) > 0}
                | {ready[v] for v, _ in gate_cols})
    if not at:
        return
    n = len(hidden)
    d = coo.add_cols(np.zeros(len(at)), np.inf, False)
    by_ready: list[list[int]] = [[] for _ in range(n)]
    for v, r in enumerate(ready):
        by_ready[r].append(v)

    def ready_in(lo: int, hi: int) -> list[int]:
        return [v for r in range(lo + 1, min(hi, n - 1) + 1) for v in by_ready[r]]

    def chain_row(rows: list[tuple[Iterable[int], tuple[np.ndarray, ...], float]],
                  extra_cols: list[int],
                  extra_vals: list[float]) -> None:
        """sum over (nodes, matrix, sign) of sign * matrix x + extra = constant parts."""
        cols, vals, const = [np.array(extra_cols)], [np.array(extra_vals, dtype=np.float64)], 0.0
        for nodes, per_node, sign in rows:
            fixed, cs, coefs = _group_terms(nodes, reduced, choice_cols, per_node)
            const += sign * fixed
            cols += cs
            vals += [sign * c / unit for c in coefs]
        row = coo.add_rows(-const / unit, -const / unit, 1)
        cat = np.concatenate(cols)
        coo.add_entries(np.full(cat.size, row), cat, np.concatenate(vals))

    def gates_in(lo: int, hi: int) -> list[int]:   # the gated seconds' columns ready there
        return [col for v, col in gate_cols if lo < ready[v] <= hi]

    # d_1 - hidden(ready after t_1) - window[0, t_1) = 0
    after = gates_in(at[0], n)
    chain_row([(ready_in(at[0], n), hidden, -1.0), (range(0, at[0]), window, -1.0)],
              [d, *after], [1.0, *(-1.0 for _ in after)])
    for k in range(len(at) - 1):   # d_{k+1} - d_k + hidden(ready in (t_k, t_{k+1}])
        step = gates_in(at[k], at[k + 1])   # - window[t_k, t_{k+1}) = 0
        chain_row([(ready_in(at[k], at[k + 1]), hidden, 1.0),
                   (range(at[k], at[k + 1]), window, -1.0)],
                  [d + k + 1, d + k, *step], [1.0, -1.0, *(1.0 for _ in step)])
    # o <= d_k
    rows = coo.add_rows(-np.inf, 0.0, len(at))
    coo.add_entries(np.concatenate([rows + np.arange(len(at))] * 2),
                    np.concatenate([np.full(len(at), o_col), d + np.arange(len(at))]),
                    np.concatenate([np.ones(len(at)), np.full(len(at), -1.0)]))


def _group_terms(nodes: Iterable[int], reduced: ReducedIlp, choice_cols: np.ndarray,
                 per_node: tuple[np.ndarray, ...]
                 ) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
    """``per_node``'s entries of ``nodes`` by group: the fixed groups' sum, then per free group
    its columns and coefficients (a group of aliased nodes adds its members')."""
    per_group: dict[int, np.ndarray] = {}
    for v in nodes:
        g = int(reduced.group_of_node[v])
        per_group[g] = per_group.get(g, 0.0) + per_node[v]
    const, cols, coefs = 0.0, [], []
    for g, values in per_group.items():
        allowed = reduced.allowed(g)
        if choice_cols[g] < 0:
            const += float(values[allowed[0]])
        else:
            cols.append(choice_cols[g] + np.arange(allowed.size))
            coefs.append(values[allowed])
    return const, cols, coefs


def _add_row(coo: _Coo, cols: list[np.ndarray], coefs: list[np.ndarray], upper: float) -> None:
    """One coupling row (memory or max cost): ``sum coefs * x[cols] <= upper``.

    The row is divided by its largest coefficient: solvers check rows with an absolute
    tolerance (1e-7), which would swallow a whole max-cost bound given in tiny cost units.
    """
    coo.num_coupling_rows += 1
    cols_all, coefs_all = np.concatenate(cols), np.concatenate(coefs)
    scale = float(np.abs(coefs_all).max()) if coefs_all.size else 0.0
    scale = scale if scale > 0 else 1.0
    row = coo.add_rows(-np.inf, upper / scale, 1)
    coo.add_entries(np.full(cols_all.size, row), cols_all, coefs_all / scale)


def build_max_cost_row(coo: _Coo, upper: float) -> None:
    """``sum_j cost_j x_j <= upper`` over the columns added so far (``upper`` net of offset).

    Raises InfeasibleIlpError when the fixed part alone already exceeds it.
    """
    cost = np.concatenate(coo.cost) if coo.cost else np.zeros(0)
    nonzero = np.flatnonzero(cost)
    if nonzero.size == 0:
        if upper < -1e-9 * max(1.0, abs(upper)):
            raise InfeasibleIlpError(f"fixed strategies already cost {-upper:.6g} more than "
                                     "max_cost")
        return
    _add_row(coo, [nonzero], [cost[nonzero]], upper)


def extract_choices(reduced: ReducedIlp, model: MilpModel, x: np.ndarray) -> tuple[int, ...]:
    """Map solved column values back to one strategy index per original node."""
    group_choice = []
    for g in range(len(reduced.costs)):
        allowed = reduced.allowed(g)
        start = int(model.choice_cols[g])
        if start < 0:
            group_choice.append(int(allowed[0]))
            continue
        block = x[start:start + allowed.size]
        assert block.max() > 0.5, f"group {g} has no strategy selected: {block}"
        group_choice.append(int(allowed[int(np.argmax(block))]))
    return tuple(group_choice[g] for g in reduced.group_of_node)


def choice_start(reduced: ReducedIlp, model: MilpModel, choices: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``s`` columns (indices, 0/1 values) that select ``choices``, one strategy index per
    original node: a partial starting point the solver completes (the other columns follow
    from these). None when the choices are not a point of this model: a group's nodes choose
    differently, or a choice the reductions forbade."""
    group_choice = np.full(len(reduced.costs), -1, dtype=np.int64)
    for node, g in enumerate(reduced.group_of_node):
        if group_choice[g] not in (-1, choices[node]):
            return None
        group_choice[g] = choices[node]
    index, value = [], []
    for g, choice in enumerate(group_choice):
        allowed = reduced.allowed(g)
        at = np.flatnonzero(allowed == choice)
        if at.size == 0:
            return None
        start = int(model.choice_cols[g])
        if start < 0:
            continue
        cols = start + np.arange(allowed.size)
        index.append(cols)
        value.append((cols == start + at[0]).astype(np.float64))
    if not index:
        return np.zeros(0, np.int32), np.zeros(0)
    return np.concatenate(index).astype(np.int32), np.concatenate(value)
