r"""Alpa's intra-op ILP (Alpa §4.2, eq. 1), linearized and solved to a proven optimum.

Given nodes ``v`` with strategy costs ``c_v`` and edges ``(u, v)`` with resharding matrices
``R_uv``, choose one strategy per node::

    min   sum_v c_v^T s_v  +  sum_{(u,v) in E} sum_{p,q} R_uv[p,q] e_uv[p,q]           (eq. 1)
                           +  sum_k c_k y_k        (shared fan-out costs, beyond Alpa)
                           -  sum_t w_t o_t        (overlapped communication, beyond Alpa)

    s.t.  sum_p s_v[p] = 1                          for every node v     build_choice_rows
          sum_q e_uv[p,q] = s_u[p]                  for every p          build_edge_rows
          sum_p e_uv[p,q] = s_v[q]                  for every q          build_edge_rows
          sum_{v in L} sum_p mem_v[p] s_v[p] + W <= budget   per live set L  build_memory_rows
          W >= sum_p work_v[p] s_v[p]               per node v with a working set
          y_k >= sum_{P x Q_i} f_ab_i               per block b = [a in P] and [some b_i in Q_i]
          y_k >= sum_{c in b} [c] - (|b| - 1)     per other block b of cost k  build_shared_rows
          z_c >= sum_{p in P} s_v[p]                per condition (v, P) of a clause c
          o_t <= sum_v hidden_tv^T s_v,  o_t <= sum_v window_tv^T s_v   build_overlap_rows
          objective <= max_cost                     (when given)         build_max_cost_row
          s_u = s_v                                 per alias (u, v)     merge_aliases
                                     (and per tie of interchangeable leaves, when asked)
          s_v[p] in {0, 1},  e_uv[p,q] >= 0

The marginal constraints replace the quadratic ``s_u^T R_uv s_v``: once ``s_u`` and ``s_v`` are
one-hot, ``e_uv`` is forced to the one-hot pair, so ``e`` may be continuous and only ``s`` is
branched on. A shared cost ``k`` (one collective serving several edges: a value resharded once
for all its consumers) is paid once when any of its blocks holds; a block is a conjunction of
clauses, a clause a disjunction of conditions "node v picks a strategy in P" (``[c]`` is
``sum_{p in P} s_v[p]`` for one condition, ``z_c`` for several); ``y`` and ``z`` are continuous
for the same reason as ``e``. Most blocks are "the producer a keeps layout P and some consumer
b_i wants Q_i": those use pair indicators ``f_ab`` (marginal rows like an edge's, over the
classes of strategies the blocks' sets tell apart), whose LP relaxation charges a half-chosen
pair half, where ``[P] + [Q] - 1`` charges it nothing: the same optimum, found ~3x faster on a
transformer layer (`benchmarks/stage_ilps.py`). The marginal
form is tighter than McCormick's ``e >= s_u + s_v - 1`` (see
``benchmarks/ilp_solvers.py``). Forbidden entries (``inf``) get no variable at all. Strategies
whose rows (columns) of ``R_uv`` are identical -- they emit (expect) the same sharding spec --
share one row (column) class, and ``e_uv`` is indexed by class pairs with the marginals summed
over each class's ``s``: exact, and about 3x fewer variables on sharding-like problems.

Before building, exact reductions (``meshplan.planner.intra.ilp_reduce``) merge aliased nodes
into one set of variables, sum parallel edges, fold a node with one allowed strategy into
constants, turn an edge with a fixed end or a separable matrix into node costs, and forbid a
strategy with no allowed partner. ``W`` (continuous) is the largest working set chosen:
memory a node holds only while a pass runs, one node at a time (a ZeRO-3 parameter gathered
whole). ``o_t`` (continuous, >= 0) is what overlap term t saves: the communication
seconds it hides, at most those charged and at most the compute beside which they run.
``min_memory`` solves ``min M`` subject to ``sum_{v in L} mem_v^T s_v + W <= M`` over
the same feasible set, ignoring costs.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from meshplan.errors import IlpCutOffError, NodeLimitError
from meshplan.planner.intra.ilp_backends import SOLVERS, run_model
from meshplan.planner.intra.ilp_model import (MemorySpec, OverlapSpec, build_model,
                                             choice_start, extract_choices)
from meshplan.planner.intra.ilp_problem import (IlpEdge, IlpProblem, IlpSolution, OverlapTerm,
                                                evaluate, peak_memory)
from meshplan.planner.intra.ilp_reduce import (ReducedIlp, interchangeable_leaves,
                                              reduce_problem)

__all__ = ["IlpEdge", "IlpProblem", "IlpSolution", "OverlapTerm", "evaluate", "min_memory",
           "peak_memory", "solve", "reduce_for_costs", "tied_leaves", "DEFAULT_SOLVER",
           "PLAN_REL_GAP", "PLAN_MAX_NODES", "PLAN_ACCEPT", "plan_solve"]

# highspy (HiGHS 1.15.1) without MIP restarts (`ilp_backends`): on the planner's own problems
# (one layer of Llama 3 70B on meshes of 4-64 devices, `benchmarks/stage_ilps.py`)
# 1.9x faster than scipy.optimize.milp (bundled HiGHS 1.12), which cannot turn restarts off;
# on the large random problems scipy is 1.0-1.3x faster.
DEFAULT_SOLVER = "highs"

# The planner's solves stop once their plan is proved within 0.1 % of the optimum, the rest
# of the search being the proof of the last fraction: MoE-10B's intra-only ILP on 16 V100s
# (440 nodes, 32 micro-batches) took 234 s to prove its optimum and 4-10 s to within 0.1 %;
# the cost model itself is trusted to a few per cent. Deterministic still (one thread, node
# counts): the same problem gives the same plan. `solve`'s own default stays the proved
# optimum.
PLAN_REL_GAP = 1e-3

# The planner's solves also stop after this many branch-and-bound nodes with the best plan
# found (its ``gap`` says how far it may be from the optimum). A memory-bound ILP often finds
# its plan at once and then spends minutes closing the last fraction of a per cent: a whole
# stage of GPT-6.7B's grid (4 blocks on 2x2, 4 in flight) had its plan at node 0, 0.5 s, and
# proved it after ~200,000 nodes, 384 s (stopped at 5000 nodes: 3.6 s, the same plan); a
# heterogeneous program of six attention blocks on 16 mixed devices under 0.05 GiB had its
# plan at node 0 and was still 0.15 % from the proof after 40 s (the dual bound never moved
# past the root; 165 s to 0.1 %). The slowest stage solves that end proved take under 5000
# nodes (Llama 3 70B's first stage 737, GPT-6.7B auto's 3195 and 4600), so they are
# unchanged. A node count, unlike a time limit, gives the same plan on any machine; and unlike
# a looser relative gap it leaves the search as it is up to the limit (HiGHS with mip_rel_gap
# 1e-3 took 255 s on a stage it proves in 72 s). The pricings of short ranges too: MoE-2.4B's
# first layer, "lean" on a (2, 4) mesh of one host, ran over 13 minutes without it.
PLAN_MAX_NODES = 5000
# ... and, where many such solves are made (the stage profiler's whole solves), stop once 50
# nodes are searched with the plan found proved within 0.5 % of the optimum (`solve`'s
# ``accept``). The root's heuristics find the plan, the proof is what costs: GPT-2.6B auto's
# nine slowest whole solves (15-98 s each, 8-block stages on 2x4) were within 0.08-0.18 %
# after 50 nodes (0.7-5.8 s), eight of them at the proved optimum and one 0.013 % above it.
PLAN_ACCEPT = (50, 0.005)


def solve(problem: IlpProblem, *, time_limit_s: float | None = None,
          solver: str = DEFAULT_SOLVER, lp_first: bool | None = None,
          max_nodes: int | None = None, accept: tuple[int, float] | None = None,
          start: tuple[int, ...] | None = None, rel_gap: float = 0.0,
          cutoff: float | None = None, search_on: bool = True,
          first_found: bool = False) -> IlpSolution:
    """Return a minimum-cost assignment of ``problem`` with zero optimality gap (``rel_gap``:
    one proved within that relative gap of the optimum, `PLAN_REL_GAP`), or, when the
    search has explored ``max_nodes`` branch-and-bound nodes without proving one, the best
    found, its ``gap`` > 0 (deterministic, unlike a time limit: the same problem gives the same
    answer on any machine; up to the limit the search is the unlimited one).
    ``accept=(nodes, gap)`` stops once ``nodes`` nodes are searched with the best assignment
    proved within the relative ``gap`` of the optimum, and otherwise the search goes on
    (deterministic too: node counts, not time). ``start`` (a strategy index per node, say the
    answer of a tied or less constrained problem) is the first assignment the search keeps
    when it satisfies this problem, so the answer is never worse than it (highspy only).
    ``cutoff``: only an assignment of objective at most this is wanted (to a relative 1e-9);
    where there is none, IlpCutOffError (highspy prunes by it and may prove so long before a
    proof of the optimum would end; scipy, without such an option, solves and compares).
    ``search_on`` False: a ``max_nodes`` search that finds no assignment raises
    NodeLimitError instead of searching on unlimited (a probe: with a cutoff, whether a
    better assignment exists within so many nodes). ``first_found``: the first assignment
    the search finds, whatever its cost (highspy; scipy solves on): any point of the feasible
    set, the same on any machine (the tests' random plans, `tests/random_plans.py`); with a
    ``start`` that satisfies the problem, that start.

    ``time_limit_s`` (seconds) bounds the solver's search; when it stops the search early the
    best assignment found is returned with its ``gap`` > 0. ``solver`` is ``"highs"``
    (``highspy``) or ``"scipy"`` (``scipy.optimize.milp``); ``lp_first`` tries the LP relaxation
    before branch and bound (None: only when no memory or max-cost row can bind). Raises
    InfeasibleIlpError when no assignment satisfies the constraints (forbidden entries, aliases,
    memory budget, ``max_cost``), TimeoutError when the limit passes before any feasible
    assignment, ImportError for ``"scipy"`` without scipy, ValueError for a bad option.
    """
    began = time.perf_counter()
    _check_options(time_limit_s, solver)
    if not (isinstance(rel_gap, (int, float)) and 0.0 <= rel_gap < 1.0):
        raise ValueError(f"rel_gap must be a relative gap in [0, 1), got {rel_gap!r}")
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int)
                                  or max_nodes < 1):
        raise ValueError(f"max_nodes must be a positive int or None, got {max_nodes!r}")
    linear = _overlap_folded(problem)
    reduced = reduce_for_costs(linear)
    memory = _memory_spec(problem, problem.memory_budget) if problem.live_sets and (
        problem.memory_budget is not None) else None
    model = build_model(reduced, memory=memory, max_cost=problem.max_cost,
                        overlap=_overlap_spec(linear))
    raw = run_model(model, solver=solver, lp_first=lp_first, time_limit_s=time_limit_s,
                    max_nodes=max_nodes, accept=accept, rel_gap=rel_gap, cutoff=cutoff,
                    search_on=search_on, first_found=first_found,
                    start=None if start is None else choice_start(reduced, model, start))
    choices = extract_choices(reduced, model, raw.x)
    node_cost, edge_cost = evaluate(problem, choices)
    if cutoff is not None and node_cost + edge_cost > cutoff + 1e-9 * abs(cutoff):
        if not search_on and raw.gap > rel_gap:   # stopped by the node limit, not a proof
            raise NodeLimitError(f"{max_nodes} nodes searched without an assignment within "
                                 f"the cutoff {cutoff}, none proved impossible")
        raise IlpCutOffError(f"the best assignment costs {node_cost + edge_cost}, over the "
                             f"cutoff {cutoff}")
    return IlpSolution(choices=choices, objective=node_cost + edge_cost, node_cost=node_cost,
                       edge_cost=edge_cost, num_variables=model.num_cols,
                       num_constraints=model.num_rows, solve_time_s=time.perf_counter() - began,
                       solver=raw.how, gap=raw.gap)


def plan_solve(problem: IlpProblem, **options: object) -> IlpSolution:
    """`solve` as the planner's searches call it for a plan: stopped within `PLAN_REL_GAP` of
    the optimum, after `PLAN_ACCEPT`'s first nodes when proved within its gap, or at
    `PLAN_MAX_NODES` (``options``: `solve`'s others, e.g. ``start``)."""
    return solve(problem, rel_gap=PLAN_REL_GAP, max_nodes=PLAN_MAX_NODES, accept=PLAN_ACCEPT,
                 **options)  # type: ignore[arg-type]


def min_memory(problem: IlpProblem, *, time_limit_s: float | None = None,
               solver: str = DEFAULT_SOLVER) -> float:
    """Return the smallest achievable peak live-set memory (bytes) over allowed assignments.

    Costs, ``memory_budget`` and ``max_cost`` are ignored; forbidden entries and aliases are
    respected. Returns 0.0 when the problem has no live sets. Raises InfeasibleIlpError when no
    assignment is allowed at all, TimeoutError/ValueError as ``solve`` does.
    """
    _check_options(time_limit_s, solver)
    if not problem.live_sets:
        return 0.0
    masks = [np.where(np.isinf(np.asarray(row, dtype=np.float64)), np.inf, 0.0)
             for row in problem.node_costs]
    edges = [(e.u, e.v, np.where(np.isinf(np.asarray(e.costs, dtype=np.float64)), np.inf, 0.0))
             for e in problem.edges]
    reduced = reduce_problem(masks, edges, problem.aliases + tied_leaves(problem))  # as `solve`
    model = build_model(reduced, memory=_memory_spec(problem, None))
    raw = run_model(model, solver=solver, lp_first=False, time_limit_s=time_limit_s)
    return peak_memory(problem, extract_choices(reduced, model, raw.x))


def reduce_for_costs(problem: IlpProblem) -> ReducedIlp:
    """Apply the exact reductions to ``problem``'s costs (see ``ilp_reduce``).

    Exposed so benchmarks can build the model themselves. Raises InfeasibleIlpError.
    """
    nodes = [np.asarray(row, dtype=np.float64) for row in problem.node_costs]
    edges = [(e.u, e.v, np.asarray(e.costs, dtype=np.float64)) for e in problem.edges]
    shared = tuple((t.cost, t.blocks) for t in problem.shared)
    return reduce_problem(nodes, edges, _tied(problem), shared)


def tied_leaves(problem: IlpProblem) -> tuple[tuple[int, int], ...]:
    """The ties `solve` adds to ``problem``'s aliases (none unless it asks for them)."""
    return interchangeable_leaves(_overlap_folded(problem)) if problem.tie_leaves else ()


def _tied(problem: IlpProblem) -> tuple[tuple[int, int], ...]:
    """``problem``'s aliases, with its interchangeable leaves' ties where it asks for them
    (of the problem with its overlap terms folded, `_overlap_folded`: ZeRO's gated seconds
    become edges between a parameter and its consumer, and leave the parameter a leaf)."""
    if not problem.tie_leaves:
        return problem.aliases
    return problem.aliases + interchangeable_leaves(problem)


def _overlap_folded(problem: IlpProblem) -> IlpProblem:
    """``problem`` with each overlap term whose saving is a sum of per-choice seconds under
    every choice folded into the node costs and, for gated seconds, into the edge between the
    node and its gate (exact, and no rows: the LP relaxation stays as tight as without the
    term). Out of order, that is where the least window exceeds the most hidden (a large model
    on fast links: the saving is the hidden seconds) or the other way round (the window). In
    order, see `_in_order_saved`."""
    costs = [list(row) for row in problem.node_costs]
    counts = problem.num_strategies   # a property that counts: once, not once per gate
    edges: dict[tuple[int, int], list[list[float]]] = {}   # joined to the problem's, gated
    kept = []
    for term in problem.overlap:
        if term.in_order:
            shares = term.saved_shares if term.linear else _in_order_saved(term)
            if shares is None:
                kept.append(term)
                continue
            for v, share in enumerate(shares):
                for p, x in enumerate(term.hidden[v]):
                    costs[v][p] -= term.weight * share * x   # inf stays inf: forbidden too
            for v, g, gate, seconds in term.gated:
                if shares[v]:
                    _fold_gate(costs, edges, counts, v, g, gate,
                               [term.weight * shares[v] * x for x in seconds])
            continue
        least = {k: math.fsum(min(row) for row in getattr(term, k)) for k in ("hidden", "window")}
        most = {k: math.fsum(max(row) for row in getattr(term, k)) for k in ("hidden", "window")}
        side = "hidden" if least["window"] >= most["hidden"] else \
            "window" if least["hidden"] >= most["window"] else None
        if side is None or term.gated:   # a gate is a choice's: no side holds under every one
            kept.append(term)
            continue
        for row, saved_s in zip(costs, getattr(term, side)):
            for p, x in enumerate(saved_s):
                row[p] -= term.weight * x
    if len(kept) == len(problem.overlap):
        return problem
    return dataclasses.replace(problem, node_costs=tuple(tuple(row) for row in costs),
                               overlap=tuple(kept), edges=_joined(problem.edges, edges))


def _in_order_saved(term: OverlapTerm) -> tuple[float, ...] | None:
    """Per node, 1 where an in-order ``term`` saves its hidden seconds (gated ones where
    their gate is open) in full under every choice, 0 where it saves none; None when what it
    saves depends on the choices. Those ready after `OverlapTerm.saved_after` are always
    saved in full; the others none where no node before that point has a window to hide
    behind (parameters, inputs: the first layer's gradients are ready as the backward
    ends)."""
    after = term.saved_after
    bare = next((u for u in range(len(term.window)) if max(term.window[u]) > 0),
                len(term.window))
    if after > bare:
        return None
    return tuple(float(term.ready_of(v) > after) for v in range(len(term.hidden)))


def _fold_gate(costs: list[list[float]], edges: dict[tuple[int, int], list[list[float]]],
               counts: tuple[int, ...], v: int, g: int, gate: tuple[int, ...],
               seconds: list[float]) -> None:
    """Take ``seconds[p]`` off node ``v``'s strategy p where node ``g`` picks none of
    ``gate``: off the node, and back on an edge from ``g`` to ``v`` where ``g`` picks one
    (costs stay non-negative)."""
    m = edges.setdefault((g, v), [[0.0] * counts[v] for _ in range(counts[g])])
    for p, x in enumerate(seconds):
        costs[v][p] -= x
        for q in gate:
            m[q][p] += x


def _joined(edges: tuple[IlpEdge, ...], extra: dict[tuple[int, int], list[list[float]]]
            ) -> tuple[IlpEdge, ...]:
    """``edges`` with the ``extra`` matrices added to the edge between the same nodes (either
    way round) where there is one, else as edges of their own."""
    if not extra:
        return edges
    out = list(edges)
    at = {(e.u, e.v): i for i, e in enumerate(edges)}
    for (u, v), m in extra.items():
        if (u, v) in at:
            i = at[(u, v)]
            out[i] = IlpEdge(u, v, tuple(tuple(a + b for a, b in zip(r, s))
                                         for r, s in zip(edges[i].costs, m)))
        elif (v, u) in at:
            i = at[(v, u)]
            out[i] = IlpEdge(v, u, tuple(tuple(a + m[q][p] for q, a in enumerate(r))
                                         for p, r in enumerate(edges[i].costs)))
        else:
            out.append(IlpEdge(u, v, tuple(tuple(r) for r in m)))
    return tuple(out)


def _overlap_spec(problem: IlpProblem) -> tuple[OverlapSpec, ...]:
    assert not any(t.linear for t in problem.overlap), "linear terms are folded"
    def arrays(matrix: tuple) -> tuple[np.ndarray, ...]:
        return tuple(np.asarray(row, dtype=np.float64) for row in matrix)
    return tuple((arrays(t.hidden), arrays(t.window), float(t.weight),
                  (tuple(range(len(t.hidden))) if t.ready is None else t.ready)
                  if t.in_order else None,
                  tuple((v, g, s, np.asarray(x, dtype=np.float64)) for v, g, s, x in t.gated))
                 for t in problem.overlap)


def _memory_spec(problem: IlpProblem, budget: float | None) -> MemorySpec:
    assert problem.node_memory is not None  # IlpProblem validation requires it with live sets
    memory = tuple(np.asarray(row, dtype=np.float64) for row in problem.node_memory)
    working = None if problem.node_working is None else tuple(
        np.asarray(row, dtype=np.float64) for row in problem.node_working)
    return MemorySpec(memory, problem.live_sets, budget, working)


def _check_options(time_limit_s: float | None, solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS}")
    if time_limit_s is not None and not (isinstance(time_limit_s, (int, float))
                                         and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be a positive number of seconds or None, "
                         f"got {time_limit_s!r}")
