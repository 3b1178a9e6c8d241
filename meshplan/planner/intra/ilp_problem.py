"""The intra-op ILP's interface values: problem, edge and solution dataclasses, plus evaluation.

Only numbers cross this boundary (STYLE §4): node indices, per-strategy costs, resharding cost
matrices, aliases and memory. A problem validates its shape when it is constructed, so every
function downstream may assume a well-formed problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class IlpEdge:
    """Resharding cost between node ``u``'s strategies (rows) and node ``v``'s (columns).

    ``costs[p][q]`` is the cost (any consistent unit, e.g. seconds) paid when ``u`` picks ``p``
    and ``v`` picks ``q``; ``math.inf`` forbids the pair. Raises ValueError for an empty or ragged
    matrix, NaN or -inf entries, or ``u == v``; TypeError when ``costs`` is not a tuple of tuples.
    """

    u: int
    v: int
    costs: Matrix

    def __post_init__(self) -> None:
        _check_index(self.u, "IlpEdge.u")
        _check_index(self.v, "IlpEdge.v")
        if self.u == self.v:
            raise ValueError(f"IlpEdge joins node {self.u} to itself; use distinct nodes")
        _check_matrix(self.costs, f"IlpEdge({self.u}, {self.v}).costs", rectangular=True)


Condition = tuple[int, tuple[int, ...]]  # (node, strategies it may pick)
Clause = tuple[Condition, ...]           # holds when any of its conditions holds
Block = tuple[Clause, ...]               # holds when all of its clauses hold


@dataclass(frozen=True)
class SharedCost:
    """A cost paid once when any of its ``blocks`` holds (a fan-out term).

    A block is a conjunction of clauses; a clause holds when any of its conditions
    ``(node, strategies)`` does, i.e. when that node picks one of those strategies. One collective
    that serves several edges -- a value moved once for all the consumers that need it in one
    layout, a tied parameter synchronized once for all its uses -- is one shared cost, e.g. with a
    block "the producer keeps layout L, and some consumer (a clause of several conditions) wants
    layout M"; pairwise edge matrices would charge it once per edge. Raises ValueError for a
    negative or non-finite cost, or an empty block, clause or strategy list.
    """

    cost: float
    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cost) and self.cost >= 0):
            raise ValueError(f"SharedCost.cost must be finite and >= 0, got {self.cost!r}")
        _check_tuple(self.blocks, "SharedCost.blocks")
        if not self.blocks:
            raise ValueError("SharedCost has no blocks; give at least one")
        for block in self.blocks:
            _check_tuple(block, "SharedCost block")
            if not block or any(not clause or any(not strategies for _, strategies in clause)
                                for clause in block):
                raise ValueError(f"SharedCost block {block!r} needs clauses of conditions "
                                 "with strategies")

    def holds(self, choices: tuple[int, ...]) -> bool:
        """Whether ``choices`` satisfy some block (the cost is then paid)."""
        return any(all(any(choices[v] in strategies for v, strategies in clause)
                       for clause in block) for block in self.blocks)


@dataclass(frozen=True)
class OverlapTerm:
    """Communication that runs beside compute, as the runtime overlaps it: of the seconds
    ``hidden[v][p]`` the objective already charges, those that fit in the chosen compute
    ``window[v][p]`` are saved, ``weight`` times per step. The objective is less
    ``weight * min(sum of chosen hidden, sum of chosen window)`` (a linear program's maximum
    of a saving bounded by both sums).

    ``in_order``: the nodes are in forward order, the backward runs them in reverse, and
    ``hidden[v]`` can start only once node v's backward is done (a gradient's all-reduce once
    the gradient is complete), so it hides only behind the backward of the nodes before v. The
    communication stream then finishes ``max_t (H_t - W_t)`` after the compute, over every
    node t with hidden seconds, ``H_t`` the hidden of nodes t and before it (they start at
    t's point or later) and ``W_t`` the window of the nodes before t (what runs after it).
    So the saving is also at most ``sum hidden - H_t + W_t`` for each such t. ``ready[v]``
    (in order; default v) is the node after whose backward v's hidden seconds can start, at
    or before v (a gradient bucket goes once its earliest-used parameter's gradient is
    complete): ``H_t`` then sums the nodes ready at t or before, per ready point t.

    ``gated``: hidden seconds ``(v, g, strategies, seconds)`` of node v (``seconds[p]`` under
    its strategy p, not in ``hidden``) that count only while node g picks none of
    ``strategies`` (a gradient's all-reduce, which a parameter updated by SFB does not have).

    ``linear`` (in order only): the saving is instead a lower bound of the in-order one under
    every choice, linear in the choices: each node's chosen hidden seconds times the share of
    its most that is saved when every node hides its most behind its least window
    (`saved_shares`; exact then). Its rows would weigh on every micro-batch (ZeRO's
    reduce-scatters, weight M - 1), and the LP relaxation of a gate times a large weight is
    weak: Llama 3 70B's stage solves ran for minutes.

    Raises ValueError for negative or non-finite entries, a negative weight, a ready point
    that is no node, or a gate of unknown nodes or strategies."""

    hidden: Matrix
    window: Matrix
    weight: float = 1.0
    in_order: bool = False
    ready: tuple[int, ...] | None = None
    gated: tuple[tuple[int, int, tuple[int, ...], tuple[float, ...]], ...] = ()
    linear: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"OverlapTerm.weight must be finite and >= 0, got {self.weight!r}")
        if self.linear and not self.in_order:
            raise ValueError("OverlapTerm.linear bounds an in-order term; set in_order too")
        for name in ("hidden", "window"):
            matrix = getattr(self, name)
            _check_matrix(matrix, f"OverlapTerm.{name}", finite=True)
            if any(x < 0 for row in matrix for x in row):
                raise ValueError(f"OverlapTerm.{name} holds a negative number of seconds")
        for v, g, strategies, seconds in self.gated:
            if not (0 <= v < len(self.hidden) and 0 <= g < len(self.hidden)
                    and len(seconds) == len(self.hidden[v])
                    and all(0 <= p < len(self.hidden[g]) for p in strategies)
                    and all(math.isfinite(x) and x >= 0 for x in seconds)):
                raise ValueError(f"OverlapTerm.gated entry {(v, g, strategies)} names a node "
                                 "or strategy the term does not have, or bad seconds")
        if self.ready is not None and (len(self.ready) != len(self.hidden) or any(
                not 0 <= r < len(self.hidden) for r in self.ready)):
            raise ValueError("OverlapTerm.ready needs one node index per node")

    def saving(self, choices: tuple[int, ...]) -> float:
        """Seconds ``choices`` save per step."""
        hidden, window = self.chosen(choices)
        if self.linear:
            return self.weight * math.fsum(f * h for f, h in zip(self.saved_shares, hidden))
        return self.saved(hidden, window)

    @cached_property
    def saved_shares(self) -> tuple[float, ...]:
        """Per node, the share of its most hidden seconds saved when every node hides its
        most behind its least window: the nodes' seconds go on one stream in the order they
        are ready (node t ready once the backward of t and the nodes after it is done),
        and what runs past the backward's end is exposed. Under any other choice each node's
        chosen seconds times its share is saved at least: for the ready point from which
        the stream runs busy to its end, what the shares keep of the seconds ready there or
        later ran before the backward's end in this worst case, within the window after that
        point, which no choice makes shorter."""
        n = len(self.hidden)
        most = [max(row) for row in self.hidden]
        for v, _, _, seconds in self.gated:
            most[v] += max(seconds)
        least_w = [min(row) for row in self.window]
        at_point: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            if most[v] > 0:
                at_point[self.ready_of(v)].append(v)
        end, done, stream = math.fsum(least_w), 0.0, 0.0
        shares = [0.0] * n
        for t in range(n - 1, -1, -1):
            done += least_w[t]   # node t's backward is done
            for v in at_point[t]:
                stream = max(stream, done) + most[v]
                shares[v] = 1.0 - min(most[v], max(stream - end, 0.0)) / most[v]
        return tuple(shares)

    def ready_of(self, v: int) -> int:
        return v if self.ready is None else self.ready[v]

    @cached_property
    def saved_after(self) -> int:
        """The earliest ready point t (-1: before the first node) such that, under every
        choice, the least window before each later ready point covers the most hidden ready
        after t up to it, and the least window in all the most hidden ready after t: the
        seconds ready after t are then all saved (each in-order bound is at least their sum,
        `caps`). Those ready at or before it are saved only as far as earlier windows allow,
        none where no node before it has a window."""
        n = len(self.hidden)
        most = [max(row) for row in self.hidden]
        for v, _, _, seconds in self.gated:
            most[v] += max(seconds)
        by_point = [0.0] * n
        for v in range(n):
            by_point[self.ready_of(v)] += most[v]
        least_w = [min(row) for row in self.window]
        # A(t): the most hidden ready at or before t; W(t): the least window before t. t is
        # valid when A(t) >= A(u) - W(u) for every ready point u after it, and for the end
        # (u = t adds nothing: A(t) - W(t) <= A(t)).
        ahead, window = [0.0] * (n + 1), [0.0] * (n + 1)
        for t in range(n):
            ahead[t + 1] = ahead[t] + by_point[t]
            window[t + 1] = window[t] + least_w[t]
        need, earliest = ahead[n] - window[n], n - 1   # n - 1 saves nothing: always valid
        for t in range(n - 1, -1, -1):
            if by_point[t] > 0:
                need = max(need, ahead[t + 1] - window[t])
            if ahead[t + 1] >= need:
                earliest = t
        return -1 if need <= 0 else earliest

    def chosen(self, choices: tuple[int, ...]) -> tuple[list[float], list[float]]:
        """The hidden (gated ones included where they count) and window seconds per node
        under ``choices``."""
        hidden = [self.hidden[v][p] for v, p in enumerate(choices)]
        for v, g, strategies, seconds in self.gated:
            if choices[g] not in strategies:
                hidden[v] += seconds[choices[v]]
        return hidden, [self.window[v][p] for v, p in enumerate(choices)]

    def saved(self, hidden: Sequence[float], window: Sequence[float]) -> float:
        """Seconds saved per step with these hidden and window seconds per node."""
        return self.weight * min(math.fsum(hidden), math.fsum(window),
                                 *(self.caps(hidden, window, ready=self.ready)
                                   if self.in_order else ()))

    @staticmethod
    def caps(hidden: Sequence[float], window: Sequence[float],
             at: Sequence[bool] | None = None, ready: Sequence[int] | None = None
             ) -> list[float]:
        """The ``in_order`` bounds of chosen ``hidden`` and ``window`` seconds per node: for
        each ready point t of a node with hidden seconds (or of each node where ``at``: a
        node without adds a bound that another already implies), the hidden of the nodes
        ready after t plus the window of those before t."""
        n = len(hidden)
        ready = range(n) if ready is None else ready
        points = sorted({ready[v] for v in range(n) if ((hidden[v] > 0) if at is None
                                                        else at[v])})
        by_point = [0.0] * n
        for v, h in enumerate(hidden):
            by_point[ready[v]] += h
        total = math.fsum(hidden)
        out, started, before_w, t = [], 0.0, 0.0, 0
        for p in points:
            while t < p:
                started += by_point[t]
                before_w += window[t]
                t += 1
            out.append(total - started - by_point[p] + before_w)
        return out


@dataclass(frozen=True)
class IlpProblem:
    """A strategy-choice problem: pick one strategy per node minimizing node plus edge costs.

    ``node_costs[v][p]`` is node ``v``'s cost under strategy ``p`` (``math.inf`` forbids it).
    ``aliases`` pairs must pick the same strategy index (they need equal strategy counts).
    ``node_memory[v][p]`` is bytes held by ``v`` under ``p``; each live set's chosen memory must
    not exceed ``memory_budget`` (bytes) when that is given. ``node_working[v][p]`` (optional)
    is bytes ``v`` holds only while a pass runs (a ZeRO-3 parameter gathered whole): nodes take
    turns, so the largest one chosen adds to every live set. ``max_cost`` caps the objective.
    ``shared`` costs are paid once each when one of their blocks holds (see `SharedCost`).
    ``overlap`` terms take back what communication overlapped with compute saves (see
    `OverlapTerm`). ``tie_leaves``: interchangeable leaves pick one strategy together
    (`ilp_reduce.interchangeable_leaves`: the same optimum without a memory budget).
    Raises ValueError naming the bad index for wrong matrix sizes, out-of-range node indices,
    aliases between nodes with different strategy counts, or memory settings without
    ``node_memory``; TypeError for lists where tuples are expected.
    """

    node_costs: Matrix
    edges: tuple[IlpEdge, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()
    node_memory: Matrix | None = None
    live_sets: tuple[tuple[int, ...], ...] = ()
    memory_budget: float | None = None
    max_cost: float | None = None
    shared: tuple[SharedCost, ...] = ()
    node_working: Matrix | None = None
    overlap: tuple[OverlapTerm, ...] = ()
    tie_leaves: bool = False

    def __post_init__(self) -> None:
        _check_matrix(self.node_costs, "node_costs")
        counts = self.num_strategies
        _check_tuple(self.edges, "edges")
        for i, edge in enumerate(self.edges):
            _check_edge(edge, i, counts)
        _check_tuple(self.shared, "shared")
        for i, term in enumerate(self.shared):
            _check_shared(term, i, counts)
        _check_aliases(self.aliases, counts)
        _check_memory(self, counts)
        _check_tuple(self.overlap, "overlap")
        for i, term in enumerate(self.overlap):
            _check_overlap(term, i, counts)
        if self.max_cost is not None and math.isnan(self.max_cost):
            raise ValueError("max_cost is NaN; give a number or None")

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_costs)

    @property
    def num_strategies(self) -> tuple[int, ...]:
        """Strategy count of each node."""
        return tuple(len(row) for row in self.node_costs)


@dataclass(frozen=True)
class IlpSolution:
    """The chosen strategy per node and how it was found.

    ``objective = node_cost + edge_cost`` recomputed exactly from ``choices`` on the original
    problem. ``num_variables``/``num_constraints`` count the model after presolve-style
    reductions (fixed nodes, merged aliases). ``solve_time_s`` is wall time of the whole
    ``solve`` call in seconds. ``solver`` names the backend and whether the LP relaxation
    sufficed (``"highs:lp"``), branch and bound ran (``"highs:mip"``) or no variable was left
    (``"presolve"``). ``gap`` is the relative MIP gap left when a time limit stopped the search
    (0.0 = proven optimal).
    """

    choices: tuple[int, ...]
    objective: float
    node_cost: float
    edge_cost: float
    num_variables: int
    num_constraints: int
    solve_time_s: float
    solver: str
    gap: float = 0.0


def evaluate(problem: IlpProblem, choices: tuple[int, ...]) -> tuple[float, float]:
    """Return ``(node_cost, edge_cost)`` of a fixed assignment, in the problem's cost unit.

    ``edge_cost`` includes the shared costs whose blocks hold; ``node_cost`` is net of what
    the ``overlap`` terms save.

    Raises ValueError when ``choices`` has the wrong length or an out-of-range index, violates an
    alias, or picks a forbidden (infinite) strategy or pair. Memory is not checked here; see
    ``peak_memory``.
    """
    _check_choices(problem, choices)
    for a, b in problem.aliases:
        if choices[a] != choices[b]:
            raise ValueError(f"alias ({a}, {b}) violated: strategies {choices[a]} != {choices[b]}")
    node_terms = [problem.node_costs[v][p] for v, p in enumerate(choices)]
    for v, cost in enumerate(node_terms):
        if math.isinf(cost):
            raise ValueError(f"node {v} picks forbidden strategy {choices[v]}")
    edge_terms = [edge.costs[choices[edge.u]][choices[edge.v]] for edge in problem.edges]
    for i, cost in enumerate(edge_terms):
        if math.isinf(cost):
            edge = problem.edges[i]
            raise ValueError(f"edge {i} ({edge.u}, {edge.v}) picks forbidden pair "
                             f"({choices[edge.u]}, {choices[edge.v]})")
    edge_terms += [t.cost for t in problem.shared if t.holds(choices)]
    saved = math.fsum(t.saving(choices) for t in problem.overlap)
    return math.fsum(node_terms) - saved, math.fsum(edge_terms)


def peak_memory(problem: IlpProblem, choices: tuple[int, ...]) -> float:
    """Return the largest live-set memory (bytes) of an assignment; 0.0 without live sets.

    Raises ValueError for malformed ``choices`` or when the problem has live sets but no
    ``node_memory``.
    """
    _check_choices(problem, choices)
    if not problem.live_sets:
        return 0.0
    memory = problem.node_memory
    assert memory is not None  # guaranteed by IlpProblem validation
    return max(math.fsum(memory[v][choices[v]] for v in live) for live in problem.live_sets) \
        + working_peak(problem, choices)


def working_peak(problem: IlpProblem, choices: tuple[int, ...]) -> float:
    """The largest ``node_working`` entry an assignment chooses (0.0 without)."""
    work = problem.node_working
    return max((work[v][p] for v, p in enumerate(choices)), default=0.0) if work else 0.0


def _check_choices(problem: IlpProblem, choices: tuple[int, ...]) -> None:
    if len(choices) != problem.num_nodes:
        raise ValueError(f"choices has {len(choices)} entries; the problem has "
                         f"{problem.num_nodes} nodes")
    for v, (p, k) in enumerate(zip(choices, problem.num_strategies)):
        if not 0 <= p < k:
            raise ValueError(f"choice {p} of node {v} is out of range; valid: 0..{k - 1}")


def _check_index(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int node index, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a node index >= 0, got {value}")


def _check_tuple(value: object, name: str) -> None:
    if not isinstance(value, tuple):
        raise TypeError(f"{name} must be a tuple (hashable), got {type(value).__name__}")


def _check_matrix(rows: Matrix, name: str, *, rectangular: bool = False,
                  finite: bool = False) -> None:
    """Tuple of non-empty tuples of numbers; no NaN, no -inf (no inf at all when ``finite``)."""
    _check_tuple(rows, name)
    if not rows:
        raise ValueError(f"{name} is empty; give at least one row")
    width = len(rows[0]) if rectangular else None
    for i, row in enumerate(rows):
        _check_tuple(row, f"{name}[{i}]")
        if not row or (width is not None and len(row) != width):
            raise ValueError(f"{name}[{i}] has {len(row)} entries; expected "
                             f"{width if width is not None else 'at least 1'}")
    flat = np.fromiter((x for row in rows for x in row), dtype=np.float64)
    bad = np.isnan(flat) | (flat == -np.inf) | (np.isinf(flat) if finite else False)
    if bad.any():
        raise ValueError(f"{name} holds {flat[bad][0]}; entries must be numbers, "
                         f"{'finite' if finite else 'possibly +inf (forbidden)'}")


def _check_edge(edge: IlpEdge, i: int, counts: tuple[int, ...]) -> None:
    if not isinstance(edge, IlpEdge):
        raise TypeError(f"edges[{i}] must be an IlpEdge, got {type(edge).__name__}")
    for end in (edge.u, edge.v):
        if end >= len(counts):
            raise ValueError(f"edges[{i}] names node {end}; valid nodes: 0..{len(counts) - 1}")
    shape = (len(edge.costs), len(edge.costs[0]))
    if shape != (counts[edge.u], counts[edge.v]):
        raise ValueError(f"edges[{i}] ({edge.u}, {edge.v}) costs are {shape[0]}x{shape[1]}; "
                         f"the nodes have {counts[edge.u]}x{counts[edge.v]} strategies")


def _check_shared(term: SharedCost, i: int, counts: tuple[int, ...]) -> None:
    if not isinstance(term, SharedCost):
        raise TypeError(f"shared[{i}] must be a SharedCost, got {type(term).__name__}")
    for block in term.blocks:
        for v, strategies in (cond for clause in block for cond in clause):
            _check_index(v, f"shared[{i}] node")
            if v >= len(counts) or any(not 0 <= p < counts[v] for p in strategies):
                raise ValueError(f"shared[{i}] names node {v} strategies {strategies}; valid "
                                 f"nodes 0..{len(counts) - 1} with their strategy ranges")


def _check_overlap(term: OverlapTerm, i: int, counts: tuple[int, ...]) -> None:
    if not isinstance(term, OverlapTerm):
        raise TypeError(f"overlap[{i}] must be an OverlapTerm, got {type(term).__name__}")
    for name in ("hidden", "window"):
        if tuple(len(row) for row in getattr(term, name)) != counts:
            raise ValueError(f"overlap[{i}].{name} needs one row per node with one entry per "
                             f"strategy ({counts})")


def _check_aliases(aliases: tuple[tuple[int, int], ...], counts: tuple[int, ...]) -> None:
    _check_tuple(aliases, "aliases")
    for i, pair in enumerate(aliases):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"aliases[{i}] must be a (u, v) tuple, got {pair!r}")
        for end in pair:
            _check_index(end, f"aliases[{i}]")
            if end >= len(counts):
                raise ValueError(f"aliases[{i}] names node {end}; valid: 0..{len(counts) - 1}")
        u, v = pair
        if counts[u] != counts[v]:
            raise ValueError(f"aliases[{i}] joins node {u} ({counts[u]} strategies) and node "
                             f"{v} ({counts[v]}); aliased nodes need equal strategy counts")


def _check_memory(problem: IlpProblem, counts: tuple[int, ...]) -> None:
    if problem.node_memory is None:
        if problem.live_sets or problem.memory_budget is not None:
            raise ValueError("live_sets/memory_budget need node_memory (bytes per strategy)")
        return
    for name in ("node_memory", "node_working"):
        matrix = getattr(problem, name)
        if matrix is None:
            continue
        _check_matrix(matrix, name, finite=True)
        if len(matrix) != len(counts):
            raise ValueError(f"{name} has {len(matrix)} rows; expected one per node "
                             f"({len(counts)})")
        for v, row in enumerate(matrix):
            if len(row) != counts[v]:
                raise ValueError(f"{name}[{v}] has {len(row)} entries; node {v} has "
                                 f"{counts[v]} strategies")
    _check_tuple(problem.live_sets, "live_sets")
    for i, live in enumerate(problem.live_sets):
        _check_tuple(live, f"live_sets[{i}]")
        for v in live:
            _check_index(v, f"live_sets[{i}]")
            if v >= len(counts):
                raise ValueError(f"live_sets[{i}] names node {v}; valid: 0..{len(counts) - 1}")
        if len(set(live)) != len(live):
            raise ValueError(f"live_sets[{i}] lists a node twice: {live}")
    budget = problem.memory_budget
    if budget is not None and not (isinstance(budget, (int, float)) and math.isfinite(budget)):
        raise ValueError(f"memory_budget must be a finite number of bytes or None, got {budget!r}")
