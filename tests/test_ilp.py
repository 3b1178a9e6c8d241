"""The ILP solver layer: XLA's toy ILP exactly, variants, brute-force cross-checks, validation."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import numpy as np
import pytest

from meshplan.errors import IlpCutOffError, InfeasibleIlpError, NodeLimitError
from meshplan.planner.intra.ilp import (IlpEdge, IlpProblem, OverlapTerm, evaluate, min_memory,
                                        peak_memory, reduce_for_costs, solve)
from meshplan.planner.intra.ilp_backends import run_model
from meshplan.planner.intra.ilp_model import build_model, extract_choices

A, B, C, D, E = range(5)
SOLVER_CONFIGS = [("highs", None), ("highs", False), ("highs", True), ("scipy", False),
                  ("scipy", True)]


def xla_toy(**changes: object) -> IlpProblem:
    """XLA's auto_sharding_solver_test toy, as in shared/reference/alpa_cases.md."""
    counts, base = (4, 3, 4, 4, 3), (10, 20, 30, 40, 50)
    compute = [[base[v] + p for p in range(k)] for v, k in enumerate(counts)]
    node_costs = tuple(tuple(11.0 * c for c in row) for row in compute)  # compute + 10x comm
    memory = ((100e3, 110e3, 990e3, 130e3), (200e3, 210e3, 220e3),
              (300e3, 310e3, 320e3, 330e3), (400e3, 410e3, 420e3, 430e3),
              (500e3, 510e3, 520e3))
    ac = tuple(tuple(1000.0 + 1000 * p + 100 * q for q in range(4)) for p in range(4))
    bc = tuple(tuple(5000.0 + 1000 * p + 100 * q for q in range(4)) for p in range(3))
    problem = IlpProblem(node_costs=node_costs, edges=(IlpEdge(A, C, ac), IlpEdge(B, C, bc)),
                         aliases=((B, E), (C, D)), node_memory=memory,
                         live_sets=((B, A), (B, A), (B, C, A), (B, C, D, A), (B, D, A)),
                         memory_budget=1_500_000.0)
    return dataclasses.replace(problem, **changes)


def with_entry(matrix: tuple[tuple[float, ...], ...], i: int, j: int,
               value: float) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(value if (r, c) == (i, j) else x for c, x in enumerate(row))
                 for r, row in enumerate(matrix))


@pytest.mark.parametrize("solver,lp_first", SOLVER_CONFIGS)
def test_xla_toy_optimum(solver: str, lp_first: bool | None) -> None:
    sol = solve(xla_toy(), solver=solver, lp_first=lp_first)
    assert sol.choices == (0, 0, 0, 0, 0)
    assert (sol.objective, sol.node_cost, sol.edge_cost) == (7650.0, 1650.0, 6000.0)
    assert sol.gap == 0.0 and sol.solver.startswith(solver)
    # Aliases share variables: A (4) + B=E (3) + C=D (4) binaries, separable edges need none.
    assert sol.num_variables == 11


@pytest.mark.parametrize("solver,lp_first", SOLVER_CONFIGS)
def test_xla_toy_forbidden_strategies(solver: str, lp_first: bool | None) -> None:
    toy = xla_toy()
    a_row = (math.inf, math.inf, math.inf, toy.node_costs[A][3])
    problem = dataclasses.replace(toy, node_costs=(a_row,) + toy.node_costs[1:])
    sol = solve(problem, solver=solver, lp_first=lp_first)
    assert sol.choices == (3, 0, 0, 0, 0)
    assert sol.objective == 10683.0


@pytest.mark.parametrize("solver,lp_first", SOLVER_CONFIGS)
def test_xla_toy_forbidden_pair(solver: str, lp_first: bool | None) -> None:
    toy = xla_toy()
    ac = toy.edges[0]
    edge = IlpEdge(ac.u, ac.v, with_entry(ac.costs, 0, 0, math.inf))
    sol = solve(dataclasses.replace(toy, edges=(edge, toy.edges[1])), solver=solver,
                lp_first=lp_first)
    assert sol.choices == (0, 0, 1, 1, 0)
    assert sol.objective == 7872.0
    assert sol.num_variables > 11  # the A-C edge is no longer separable: it needs variables


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_xla_toy_max_cost(solver: str) -> None:
    with pytest.raises(InfeasibleIlpError):
        solve(xla_toy(max_cost=7600.0), solver=solver)
    assert solve(xla_toy(max_cost=7650.0), solver=solver).objective == 7650.0


def test_xla_toy_evaluate() -> None:
    node_cost, edge_cost = evaluate(xla_toy(), (3, 1, 2, 2, 1))
    assert (node_cost, edge_cost) == (159.0 + 1590.0, 10400.0)
    assert node_cost + edge_cost == 12149.0


def test_evaluate_rejects_bad_assignments() -> None:
    toy = xla_toy()
    with pytest.raises(ValueError, match="alias"):
        evaluate(toy, (0, 0, 1, 0, 0))
    with pytest.raises(ValueError, match="out of range"):
        evaluate(toy, (4, 0, 0, 0, 0))
    forbidden = dataclasses.replace(toy, edges=(IlpEdge(A, C, with_entry(
        toy.edges[0].costs, 1, 2, math.inf)), toy.edges[1]))
    with pytest.raises(ValueError, match="forbidden pair"):
        evaluate(forbidden, (1, 0, 2, 2, 0))


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_memory_budget_and_min_memory(solver: str) -> None:
    toy = xla_toy()
    # Cheapest memory: A0 + B0 + C0 + D0 in the live set {B, C, D, A}.
    assert min_memory(toy, solver=solver) == 1_000_000.0
    assert solve(xla_toy(memory_budget=1_000_000.0), solver=solver).choices == (0,) * 5
    with pytest.raises(InfeasibleIlpError):
        solve(xla_toy(memory_budget=999_999.0), solver=solver)
    # A's strategy 2 is cheapest but needs 990k: a budget it breaks pushes A elsewhere.
    cheap_a2 = dataclasses.replace(toy, node_costs=((3e3, 3e3, 0.0, 3e3),) + toy.node_costs[1:])
    assert solve(cheap_a2, solver=solver).choices[A] != 2
    assert solve(dataclasses.replace(cheap_a2, memory_budget=3e6), solver=solver).choices[A] == 2


def test_min_memory_respects_aliases_and_forbidden_entries() -> None:
    # Node 0 is lightest under strategy 0, node 1 under strategy 1; node 2 is forced to 0.
    problem = IlpProblem(node_costs=((0.0, 0.0), (0.0, 0.0), (0.0, math.inf)),
                         node_memory=((1.0, 5.0), (9.0, 2.0), (2.5, 0.0)),
                         live_sets=((0, 1), (2,)))
    assert min_memory(problem) == 3.0  # (0, 1): 1 + 2
    aliased = dataclasses.replace(problem, aliases=((0, 1),))
    assert min_memory(aliased) == 7.0  # (1, 1): 5 + 2 beats (0, 0): 1 + 9
    no_01 = (IlpEdge(0, 1, ((0.0, math.inf), (0.0, 0.0))),)
    assert min_memory(dataclasses.replace(problem, edges=no_01)) == 7.0
    no_11 = (IlpEdge(0, 1, ((0.0, 0.0), (0.0, math.inf))),)
    assert min_memory(dataclasses.replace(aliased, edges=no_11)) == 10.0


def test_edge_with_a_fixed_end_becomes_node_costs() -> None:
    problem = IlpProblem(node_costs=((math.inf, 5.0), (1.0, 1.0, 1.0)),
                         edges=(IlpEdge(0, 1, ((0.0, 0.0, 0.0), (7.0, 3.0, 4.0))),))
    sol = solve(problem)
    assert sol.choices == (1, 1) and sol.objective == 9.0 and sol.edge_cost == 3.0
    assert sol.num_variables == 3 and sol.num_constraints == 1  # node 1's one-hot only


def test_everything_fixed_needs_no_solver() -> None:
    problem = IlpProblem(node_costs=((2.0,), (math.inf, 3.0)),
                         edges=(IlpEdge(0, 1, ((1.0, 4.0),)),))
    sol = solve(problem)
    assert (sol.choices, sol.objective, sol.solver, sol.num_variables) == ((0, 1), 9.0,
                                                                           "presolve", 0)


def test_every_strategy_forbidden_is_infeasible() -> None:
    with pytest.raises(InfeasibleIlpError, match="node 1"):
        solve(IlpProblem(node_costs=((1.0, 2.0), (math.inf, math.inf))))
    forbidden_pairs = IlpProblem(node_costs=((1.0, 2.0), (1.0, 2.0)),
                                 edges=(IlpEdge(0, 1, ((math.inf, 0.0), (math.inf, math.inf))),),
                                 aliases=((0, 1),))
    with pytest.raises(InfeasibleIlpError):
        solve(forbidden_pairs)  # the only allowed pair (0, 1) breaks the alias


def brute_force(problem: IlpProblem) -> tuple[float, float] | None:
    """(min objective, min peak memory) over all allowed assignments; None if none satisfies."""
    best, best_memory = math.inf, math.inf
    for choices in itertools.product(*(range(k) for k in problem.num_strategies)):
        try:
            cost = sum(evaluate(problem, choices))
        except ValueError:
            continue
        memory = peak_memory(problem, choices)
        best_memory = min(best_memory, memory)
        within_budget = problem.memory_budget is None or memory <= problem.memory_budget
        if within_budget and (problem.max_cost is None or cost <= problem.max_cost):
            best = min(best, cost)
    return None if math.isinf(best_memory) else (best, best_memory)


def random_problem(rng: random.Random) -> IlpProblem:
    n = rng.randint(2, 6)
    counts = [rng.randint(1, 4) for _ in range(n)]
    node_costs = tuple(tuple(math.inf if rng.random() < 0.1 else float(rng.randint(0, 20))
                             for _ in range(k)) for k in counts)
    edges = []
    for _ in range(rng.randint(0, 2 * n)):
        u, v = rng.sample(range(n), 2)
        costs = tuple(tuple(math.inf if rng.random() < 0.1 else float(rng.randint(0, 30) * (p != q))
                            for q in range(counts[v])) for p in range(counts[u]))
        edges.append(IlpEdge(u, v, costs))
    same = [(u, v) for u in range(n) for v in range(u + 1, n) if counts[u] == counts[v]]
    aliases = tuple(rng.sample(same, min(len(same), rng.randint(0, 1))))
    memory = tuple(tuple(float(rng.randint(1, 10)) for _ in range(k)) for k in counts)
    live = tuple(tuple(rng.sample(range(n), rng.randint(1, n))) for _ in range(rng.randint(0, 3)))
    budget = float(rng.randint(5, 25)) if live and rng.random() < 0.7 else None
    max_cost = float(rng.randint(0, 60)) if rng.random() < 0.2 else None
    # Half the problems have working sets (held one node at a time: the largest chosen adds
    # to every live set), on some nodes' strategies.
    working = tuple(tuple(float(rng.choice((0, 0, rng.randint(1, 8)))) for _ in range(k))
                    for k in counts) if rng.random() < 0.5 else None
    # Some have overlap terms: a saving of weight * min(hidden, window) over the choices.
    def seconds(top: int) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(float(rng.randint(0, top)) for _ in range(k)) for k in counts)
    # Half of them in order: hidden seconds hide only behind the windows of earlier nodes,
    # half of those from ready points of their own (gradient buckets).
    def term() -> OverlapTerm:
        in_order = rng.random() < 0.5
        ready = tuple(rng.randint(0, n - 1) for _ in range(n)) \
            if in_order and rng.random() < 0.5 else None
        # Some hidden seconds count only while another node avoids some strategies.
        gated = tuple((v, g, tuple(rng.sample(range(counts[g]), rng.randint(1, counts[g]))),
                       tuple(float(rng.randint(0, 6)) for _ in range(counts[v])))
                      for v, g in (rng.sample(range(n), 2) for _ in range(rng.choice((0, 1, 2)))))
        return OverlapTerm(seconds(6), seconds(4), float(rng.randint(0, 3)), in_order, ready,
                           gated, linear=in_order and rng.random() < 0.3)
    overlap = tuple(term() for _ in range(rng.choice((0, 0, 1, 2))))
    return IlpProblem(node_costs, tuple(edges), aliases, memory, live, budget, max_cost,
                      node_working=working, overlap=overlap)


@pytest.mark.parametrize("solver,lp_first", SOLVER_CONFIGS)
def test_random_problems_match_brute_force(solver: str, lp_first: bool | None) -> None:
    rng = random.Random(1234)
    checked = {"solved": 0, "infeasible": 0}
    for _ in range(60):
        problem = random_problem(rng)
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            with pytest.raises(InfeasibleIlpError):
                solve(problem, solver=solver, lp_first=lp_first)
            checked["infeasible"] += 1
        else:
            sol = solve(problem, solver=solver, lp_first=lp_first)
            assert sol.objective == pytest.approx(expected[0], abs=1e-6), problem
            assert sol.objective == pytest.approx(sum(evaluate(problem, sol.choices)))
            checked["solved"] += 1
        if expected is not None and problem.live_sets:
            assert min_memory(problem, solver=solver) == pytest.approx(expected[1])
    assert checked["solved"] >= 20 and checked["infeasible"] >= 5, checked


def test_a_cutoff_below_the_optimum_is_refused_and_one_at_it_kept() -> None:
    # A whole stage's solve given the latency another logical mesh already reached: HiGHS
    # prunes by it and says when nothing is that good (the objective it prunes by is the
    # one `evaluate` gives, overlap savings, shared costs and constants included).
    rng = random.Random(99)
    cut = kept = 0
    for _ in range(60):
        problem = random_problem(rng)
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            continue
        with pytest.raises(IlpCutOffError):
            solve(problem, cutoff=expected[0] - 1e-3)
        cut += 1
        for cutoff in (expected[0], expected[0] + 5.0):
            sol = solve(problem, cutoff=cutoff)
            assert sol.objective == pytest.approx(expected[0], abs=1e-6), problem
        kept += 1
        with pytest.raises(IlpCutOffError):   # scipy has no cutoff: it solves, then compares
            solve(problem, solver="scipy", cutoff=expected[0] - 1e-3)
    assert cut >= 20 and kept >= 20


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_a_relative_gap_gives_a_plan_proved_that_close(solver: str) -> None:
    """The planner's solves (`PLAN_REL_GAP`) stop once their best assignment is proved within
    the gap: an allowed assignment (forbidden entries, budget, aliases) within it of the
    brute-force optimum, and the gap they report no larger."""
    rng = random.Random(77)
    solved = 0
    for _ in range(60):
        problem = random_problem(rng)
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            continue
        sol = solve(problem, solver=solver, rel_gap=0.25)
        cost = sum(evaluate(problem, sol.choices))   # raises on a forbidden choice
        # (HiGHS's gap is relative to the assignment's own objective, which may be < 0.)
        assert cost - expected[0] <= 0.25 * max(abs(cost), abs(expected[0])) + 1e-6, \
            (cost, expected[0])
        assert problem.memory_budget is None or \
            peak_memory(problem, sol.choices) <= problem.memory_budget + 1e-9
        assert 0.0 <= sol.gap <= 0.25 + 1e-9
        solved += 1
    assert solved >= 20
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="rel_gap"):
            solve(xla_toy(), rel_gap=bad)


def test_in_order_terms_folded_into_costs_match_brute_force() -> None:
    """An in-order term whose saving is the same sum under every choice is folded into the
    node and edge costs instead of rows (`ilp._overlap_folded`): what is ready before the
    first window (a first layer's gradients, ready as the backward ends) saves nothing, the
    rest, gated seconds included, all of it. Random problems built to fold (wide windows after
    a prefix without any) and some that just miss: the same optimum as brute force."""
    from meshplan.planner.intra.ilp import _overlap_folded
    rng = random.Random(27)
    folded = 0
    for _ in range(60):
        base = random_problem(rng)
        n, counts = base.num_nodes, base.num_strategies
        bare = rng.randint(0, min(2, n - 1))
        window = tuple(tuple(0.0 if v < bare else float(rng.randint(3, 8)) for _ in range(k))
                       for v, k in enumerate(counts))
        hidden = tuple(tuple(float(rng.randint(0, 2)) for _ in range(k)) for k in counts)
        gated = tuple((v, g, tuple(rng.sample(range(counts[g]), rng.randint(1, counts[g]))),
                       tuple(float(rng.randint(0, 3)) for _ in range(counts[v])))
                      for v, g in (rng.sample(range(n), 2) for _ in range(rng.randint(0, 3))))
        ready = tuple(rng.randint(0, n - 1) for _ in range(n)) if rng.random() < 0.5 else None
        problem = dataclasses.replace(base, overlap=(OverlapTerm(
            hidden, window, float(rng.randint(1, 4)), True, ready, gated,
            linear=rng.random() < 0.3),))
        folded += not _overlap_folded(problem).overlap
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            with pytest.raises(InfeasibleIlpError):
                solve(problem)
            continue
        assert solve(problem).objective == pytest.approx(expected[0], abs=1e-6), problem
    assert folded >= 20, folded


def test_a_linear_term_never_saves_more_than_the_in_order_one() -> None:
    """``OverlapTerm.linear`` prices a lower bound of the in-order saving (each node's share
    saved when every node hides its most behind its least window): under every choice of
    random terms it saves no more than the in-order term, and as much where the choices are
    that worst case."""
    rng = random.Random(5)
    tight = 0
    for _ in range(300):
        n = rng.randint(1, 5)
        counts = [rng.randint(1, 3) for _ in range(n)]
        rows = lambda top: tuple(tuple(float(rng.randint(0, top)) for _ in range(k))  # noqa: E731
                                 for k in counts)
        gated = tuple((v, g, tuple(rng.sample(range(counts[g]), rng.randint(1, counts[g]))),
                       tuple(float(rng.randint(0, 5)) for _ in range(counts[v])))
                      for v, g in (rng.sample(range(n), 2)
                                   for _ in range(rng.randint(0, 2) if n > 1 else 0)))
        ready = tuple(rng.randint(0, n - 1) for _ in range(n)) if rng.random() < 0.5 else None
        exact = OverlapTerm(rows(6), rows(5), 1.0, True, ready, gated)
        linear = dataclasses.replace(exact, linear=True)
        for choices in itertools.product(*(range(k) for k in counts)):
            assert linear.saving(choices) <= exact.saving(choices) + 1e-9, (exact, choices)
        worst = tuple(min(range(k), key=lambda p: exact.window[v][p]) for v, k in
                      enumerate(counts))
        if all(exact.hidden[v][worst[v]] == max(exact.hidden[v]) for v in range(n)) and \
                all(worst[g] not in gate for _, g, gate, _ in gated) and \
                all(s[worst[v]] == max(s) for v, _, _, s in gated):
            assert linear.saving(worst) == pytest.approx(exact.saving(worst))
            tight += 1
    assert tight >= 20, tight


def test_an_overlap_term_saves_the_smaller_of_what_it_hides_and_its_window() -> None:
    """Node 0 picks between a cheap strategy and one that costs 3 more but whose 5 seconds
    of communication can hide behind node 1's compute window: hidden beside a window of 4,
    it saves 4 and wins; beside a window of 2, it saves 2 and loses."""
    def problem(window: float) -> IlpProblem:
        return IlpProblem(node_costs=((10.0, 13.0), (1.0,)), overlap=(OverlapTerm(
            hidden=((0.0, 5.0), (0.0,)), window=((0.0, 0.0), (window,)), weight=1.0),))
    wins = solve(problem(4.0))
    assert wins.choices == (1, 0) and wins.objective == pytest.approx(13 + 1 - 4)
    loses = solve(problem(2.0))
    assert loses.choices == (0, 0) and loses.objective == pytest.approx(11)
    assert sum(evaluate(problem(2.0), (1, 0))) == pytest.approx(12)
    with pytest.raises(ValueError, match="negative"):
        OverlapTerm(hidden=((-1.0,),), window=((0.0,),))
    with pytest.raises(ValueError, match="one row per node"):
        IlpProblem(node_costs=((1.0, 2.0),), overlap=(OverlapTerm(((0.0,),), ((0.0,),)),))


def test_in_order_communication_hides_only_behind_the_backward_after_it() -> None:
    """In order, node v's hidden seconds start when v's backward is done: the backward runs
    the nodes in reverse, so they hide behind the windows of the nodes before v only. A
    gradient of the last node hides behind the first node's window; one of the first node
    has nothing after it; of three syncs, each is bounded by what comes after it."""
    def saving(hidden: tuple[float, ...], window: tuple[float, ...], in_order: bool,
               ready: tuple[int, ...] | None = None) -> float:
        n = len(hidden)
        problem = IlpProblem(node_costs=tuple((10.0,) for _ in range(n)), overlap=(OverlapTerm(
            tuple((h,) for h in hidden), tuple((w,) for w in window), in_order=in_order,
            ready=ready),))
        sol = solve(problem)
        assert sol.objective == pytest.approx(sum(evaluate(problem, sol.choices)))
        return 10.0 * n - sol.objective
    assert saving((0.0, 5.0), (4.0, 0.0), True) == pytest.approx(4.0)
    assert saving((5.0, 0.0), (0.0, 4.0), True) == pytest.approx(0.0)
    assert saving((5.0, 0.0), (0.0, 4.0), False) == pytest.approx(4.0)
    # Syncs of 3, 2 and 1 s at nodes 0, 2 and 4, windows of 2 s at nodes 1 and 3: the 1 s
    # sync runs at once, the 2 s one from 2 to 4 and the 3 s one from 4, when the compute
    # is over: 3 s saved of 6 (4 without the order).
    assert saving((3.0, 0.0, 2.0, 0.0, 1.0), (0.0, 2.0, 0.0, 2.0, 0.0), True) == \
        pytest.approx(3.0)
    assert saving((3.0, 0.0, 2.0, 0.0, 1.0), (0.0, 2.0, 0.0, 2.0, 0.0), False) == \
        pytest.approx(4.0)
    # The 1 s sync in a bucket with the 2 s one (both ready at node 2): 3 s from 2 to 5,
    # then the 3 s sync: 2 s saved.
    assert saving((3.0, 0.0, 2.0, 0.0, 1.0), (0.0, 2.0, 0.0, 2.0, 0.0), True,
                  (0, 1, 2, 3, 2)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one node index per node"):
        OverlapTerm(((1.0,), (1.0,)), ((0.0,), (0.0,)), in_order=True, ready=(2, 1))


def test_gated_seconds_hide_only_while_the_gate_is_open() -> None:
    """Node 1's 3 s hide behind node 0's window of 5 unless node 0 picks strategy 1 (a
    parameter updated by SFB has no all-reduce to hide): then nothing is saved."""
    def problem(cost_of_gate: float) -> IlpProblem:
        return IlpProblem(node_costs=((10.0, cost_of_gate), (20.0,)), overlap=(OverlapTerm(
            ((0.0, 0.0), (0.0,)), ((5.0, 5.0), (0.0,)), in_order=True,
            gated=((1, 0, (1,), (3.0,)),)),))
    assert solve(problem(8.0)).choices == (0, 0)   # 10 + 20 - 3 = 27 against 28
    assert solve(problem(6.0)).choices == (1, 0)   # 26 against 27
    assert sum(evaluate(problem(6.0), (0, 0))) == pytest.approx(27.0)
    with pytest.raises(ValueError, match="gated"):
        OverlapTerm(((0.0,),), ((0.0,),), gated=((0, 0, (1,), (1.0,)),))


def test_an_overlap_terms_rows_span_no_more_than_its_seconds() -> None:
    """A stage's overlap term holds seconds from nanoseconds to tens of milliseconds; its
    saving, gated and in-order columns are in units of its largest entry, so the model's
    coefficients span no more than the term's own entries do (a saving in seconds beside the
    in-order chain's units spanned 2e-9..110, and HiGHS's dual simplex crawled at the root
    for minutes on a Gemma 2 layer). The optimum is the brute force's either way."""
    rng = random.Random(5)
    n = 6
    seconds = [tuple(10.0 ** rng.uniform(-9, -2) for _ in range(3)) for _ in range(n)]
    window = [tuple(10.0 ** rng.uniform(-6, -2) for _ in range(3)) for _ in range(n)]
    problem = IlpProblem(
        node_costs=tuple(tuple(rng.uniform(1e-3, 2e-2) for _ in range(3)) for _ in range(n)),
        edges=tuple(IlpEdge(v, v + 1, tuple(tuple(rng.uniform(0, 1e-3) for _ in range(3))
                                             for _ in range(3))) for v in range(n - 1)),
        overlap=(OverlapTerm(tuple(seconds), tuple(window), 3.0, in_order=True,
                             ready=(0, 0, 2, 2, 4, 5), gated=((3, 1, (2,), (4e-9, 1e-3, 5e-3)),)),))
    entries = [x for row in (*seconds, *window, (4e-9, 1e-3, 5e-3)) for x in row]
    from meshplan.planner.intra.ilp import _overlap_spec
    model = build_model(reduce_for_costs(problem), overlap=_overlap_spec(problem))
    coefs = np.abs(model.vals[model.vals != 0])
    assert coefs.max() <= 1.0 + 1e-12
    assert coefs.min() >= min(entries) / max(entries) * (1 - 1e-9)
    assert solve(problem).objective == pytest.approx(brute_force(problem)[0], rel=1e-9)


def test_mccormick_form_matches_marginal_form() -> None:
    rng = random.Random(99)
    for _ in range(30):
        problem = random_problem(rng)
        try:
            marginal = solve(problem).objective
        except InfeasibleIlpError:
            continue
        reduced = reduce_for_costs(problem)
        model = build_model(reduced, max_cost=problem.max_cost, edge_form="mccormick")
        if problem.memory_budget is not None or problem.overlap:
            continue  # memory and overlap rows are shared code; the edge forms are what differs
        raw = run_model(model, solver="highs", lp_first=False, time_limit_s=None)
        assert sum(evaluate(problem, extract_choices(reduced, model, raw.x))) == marginal


def chain_problem(num_nodes: int, seed: int) -> IlpProblem:
    """A chain with 4-8 strategies per node and zero-diagonal resharding costs."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(4, 9, size=num_nodes)
    node_costs = tuple(tuple(float(x) for x in rng.integers(0, 50, size=k)) for k in counts)
    edges = []
    for v in range(1, num_nodes):
        mat = rng.integers(1, 100, size=(counts[v - 1], counts[v])).astype(float)
        k = min(counts[v - 1], counts[v])
        mat[np.arange(k), np.arange(k)] = 0.0
        edges.append(IlpEdge(v - 1, v, tuple(tuple(float(x) for x in row) for row in mat)))
    return IlpProblem(node_costs, tuple(edges))


def chain_optimum(problem: IlpProblem) -> float:
    """Viterbi dynamic program: the exact optimum of a chain."""
    best = np.asarray(problem.node_costs[0])
    for edge in problem.edges:
        best = (best[:, None] + np.asarray(edge.costs)).min(axis=0) + np.asarray(
            problem.node_costs[edge.v])
    return float(best.min())


def test_3000_node_chain_solves_in_seconds() -> None:
    problem = chain_problem(3000, seed=7)
    start = time.perf_counter()
    sol = solve(problem)
    elapsed = time.perf_counter() - start
    assert sol.objective == pytest.approx(chain_optimum(problem), abs=1e-6)
    assert elapsed < 15.0, f"3000-node chain took {elapsed:.1f} s"
    # No coupling rows, so the LP relaxation runs first; on a tree it is integral.
    assert sol.solver.endswith(":lp")


def memory_bound_dag(num_nodes: int, seed: int) -> IlpProblem:
    """A DAG with skip edges and random memory under a binding budget (integer costs)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(3, 7, size=num_nodes)
    preds = [[v - 1] + ([int(rng.integers(0, v - 1))] if v > 1 and rng.random() < 0.3 else [])
             for v in range(1, num_nodes)]
    edges = []
    for v, ps in enumerate(preds, start=1):
        for u in ps:
            mat = rng.integers(1, 100, size=(counts[u], counts[v])).astype(float)
            mat[np.arange(min(counts[u], counts[v])), np.arange(min(counts[u], counts[v]))] = 0
            edges.append(IlpEdge(u, v, tuple(tuple(float(x) for x in row) for row in mat)))
    problem = IlpProblem(
        node_costs=tuple(tuple(float(x) for x in rng.integers(0, 50, size=k)) for k in counts),
        edges=tuple(edges),
        node_memory=tuple(tuple(float(x) for x in rng.integers(1, 100, size=k)) for k in counts),
        live_sets=tuple(tuple(range(t, min(t + 6, num_nodes))) for t in range(num_nodes - 5)))
    low, high = min_memory(problem), peak_memory(problem, solve(problem).choices)
    return dataclasses.replace(problem, memory_budget=(low + high) / 2)


def scale_costs(problem: IlpProblem, factor: float) -> IlpProblem:
    def scaled(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(x * factor for x in row) for row in rows)
    return dataclasses.replace(problem, node_costs=scaled(problem.node_costs),
                               edges=tuple(IlpEdge(e.u, e.v, scaled(e.costs))
                                           for e in problem.edges))


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_tiny_cost_units_still_reach_the_optimum(solver: str) -> None:
    # Costs in seconds are ~1e-9..1e-5 each, below HiGHS's absolute tolerances (1e-7 on reduced
    # costs, scipy's 1e-6 gap): unless the backend rescales them, it stops ~2x above optimum.
    problem = memory_bound_dag(30, seed=2)
    exact = solve(problem, solver=solver).objective
    tiny = solve(scale_costs(problem, 1e-9), solver=solver)
    assert tiny.objective == pytest.approx(exact * 1e-9, rel=1e-9)


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_max_cost_in_tiny_units(solver: str) -> None:
    # Rows are checked with an absolute tolerance, so the max-cost row must be normalized.
    unit = 1e-12
    with pytest.raises(InfeasibleIlpError):
        solve(scale_costs(xla_toy(max_cost=7600 * unit), unit), solver=solver)
    sol = solve(scale_costs(xla_toy(max_cost=7651 * unit), unit), solver=solver)
    assert sol.objective == pytest.approx(7650 * unit)


@pytest.mark.parametrize("build,match", [
    (lambda: IlpProblem(((1.0, 2.0),), (IlpEdge(0, 1, ((0.0,), (0.0,))),)), "node 1"),
    (lambda: IlpProblem(((1.0, 2.0), (1.0,)), (IlpEdge(0, 1, ((0.0, 1.0), (0.0, 1.0))),)),
     r"edges\[0\].*2x2.*2x1"),
    (lambda: IlpProblem(((1.0, 2.0), (1.0,)), aliases=((0, 1),)), r"aliases\[0\].*equal"),
    (lambda: IlpProblem(((1.0,),), live_sets=((0,),)), "node_memory"),
    (lambda: IlpProblem(((1.0,), (2.0,)), node_memory=((1.0,),)), "node_memory has 1 rows"),
    (lambda: IlpProblem(((1.0,),), node_memory=((1.0,),), live_sets=((0, 0),)), "twice"),
    (lambda: IlpProblem(((float("nan"),),)), "nan"),
    (lambda: IlpEdge(0, 1, ((0.0, 1.0), (0.0,))), r"costs\[1\] has 1 entries"),
])
def test_validation_names_the_bad_index(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]


def test_validation_type_errors_and_options() -> None:
    with pytest.raises(TypeError, match="tuple"):
        IlpProblem([[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="solver"):
        solve(xla_toy(), solver="cplex")
    with pytest.raises(ValueError, match="time_limit_s"):
        solve(xla_toy(), time_limit_s=0.0)
    assert hash(xla_toy()) == hash(xla_toy())  # problems are hashable values for caching


@pytest.mark.parametrize("solver", ["highs", "scipy"])
def test_a_node_limit_gives_the_best_plan_found(solver: str) -> None:
    """``max_nodes`` stops branch and bound there with the best plan found and its gap (whole
    stage solves use it): a search that needs fewer nodes is the unlimited one; one stopped
    early returns a feasible plan no better than the optimum, the same every time."""
    stopped = 0
    for seed in (1, 3):   # one the root solves, one it does not
        problem = memory_bound_dag(24, seed)
        exact = solve(problem, solver=solver)
        assert solve(problem, solver=solver, max_nodes=10**6).choices == exact.choices
        got = solve(problem, solver=solver, max_nodes=1)
        assert got.objective >= exact.objective * (1 - 1e-9)
        assert peak_memory(problem, got.choices) <= problem.memory_budget * (1 + 1e-9)
        assert solve(problem, solver=solver, max_nodes=1).choices == got.choices
        if got.objective > exact.objective * (1 + 1e-9):
            stopped += 1
            assert got.gap > 0
    assert stopped   # the limit stopped a search before its optimum
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_nodes"):
            solve(xla_toy(), max_nodes=bad)


def test_the_first_assignment_found_is_allowed_and_the_same_every_time() -> None:
    """``first_found``: the search's first point, whatever it costs (the tests' random plans
    draw from the feasible set so): it breaks no forbidden entry, alias, memory budget nor
    cost bound, and the same problem gives the same point (node counts, not a time limit)."""
    rng = random.Random(77)
    worse = 0
    for _ in range(40):
        problem = random_problem(rng)
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            with pytest.raises(InfeasibleIlpError):
                solve(problem, first_found=True)
            continue
        got = solve(problem, first_found=True, lp_first=False)
        assert got.objective == pytest.approx(sum(evaluate(problem, got.choices)))
        assert got.objective >= expected[0] - 1e-6
        if problem.memory_budget is not None:
            assert peak_memory(problem, got.choices) <= problem.memory_budget * (1 + 1e-9)
        if problem.max_cost is not None:
            assert got.objective <= problem.max_cost + 1e-6
        assert solve(problem, first_found=True, lp_first=False).choices == got.choices
    for seed in (1, 3, 5):   # larger: the first point is not always the optimum
        problem = memory_bound_dag(24, seed)
        got = solve(problem, first_found=True, lp_first=False)
        assert peak_memory(problem, got.choices) <= problem.memory_budget * (1 + 1e-9)
        worse += got.objective > solve(problem).objective * (1 + 1e-9)
    assert worse   # it stopped before the optimum somewhere


def test_accept_stops_early_only_within_its_gap() -> None:
    """``accept=(nodes, gap)``: the first ``nodes`` nodes' plan is kept when proved within
    ``gap`` of the optimum (whole stage solves: the proof, not the plan, is what costs), and
    otherwise the search goes on to the optimum (or ``max_nodes``)."""
    problem = memory_bound_dag(24, 5)   # one whose root does not find the optimum
    exact = solve(problem)
    loose = solve(problem, max_nodes=10**6, accept=(1, 0.5))
    assert exact.objective < loose.objective <= exact.objective * (1 + 0.5)   # stopped early
    assert loose.gap <= 0.5
    assert solve(problem, max_nodes=10**6, accept=(1, 0.0)).objective == exact.objective


def test_a_solve_not_accepted_at_its_first_nodes_goes_on(monkeypatch) -> None:
    """Where ``accept``'s first nodes do not prove their point, the search goes on: to
    ``max_nodes`` with a feasible point, or without a limit to the optimum. HiGHS checks
    ``accept`` as it searches, in one run (a second search would redo the root: on MoE-70B's
    and BERT-MoE's planning, a fifth of their HiGHS time)."""
    from meshplan.planner.intra import ilp_backends
    runs: list[bool] = []
    counted = ilp_backends._run_highs

    def counting(*args, **kwargs):
        runs.append(kwargs.get("relax", False))
        return counted(*args, **kwargs)

    monkeypatch.setattr(ilp_backends, "_run_highs", counting)
    limited = 0
    for seed in range(8):
        problem = memory_bound_dag(20, seed)
        runs.clear()
        got = solve(problem, max_nodes=3, accept=(1, 0.0))
        assert runs == [False], seed   # one MIP search: no LP first, no second search
        assert peak_memory(problem, got.choices) <= problem.memory_budget * (1 + 1e-9)
        limited += got.gap > 0
    assert limited   # some searches were stopped by the node limit, not accepted or proved
    problem = memory_bound_dag(24, 5)   # one whose root does not find the optimum
    assert solve(problem, accept=(1, 0.0)).objective == solve(problem).objective


def test_a_highspy_without_interrupt_callbacks_probes_and_searches_again(monkeypatch) -> None:
    """A highspy release without a subscribable MIP-interrupt callback (the package allows
    highspy 1.7) accepts as scipy does: a probe of ``accept``'s nodes, then, not accepted,
    the search again, whose answer or the probe's, the better, is kept."""
    import highspy
    from meshplan.planner.intra import ilp_backends
    runs: list[dict] = []
    counted = ilp_backends._run_highs

    def counting(*args, **kwargs):
        runs.append(kwargs)
        return counted(*args, **kwargs)

    monkeypatch.setattr(ilp_backends, "_run_highs", counting)
    monkeypatch.delattr(highspy.Highs, "cbMipInterrupt")
    problem = memory_bound_dag(20, 5)
    alone = solve(problem, max_nodes=3)
    runs.clear()
    got = solve(problem, max_nodes=3, accept=(1, 0.0))
    assert [r.get("max_nodes") for r in runs] == [1, 3]
    assert all(r.get("accept") is None for r in runs)
    assert got.objective <= alone.objective


def test_a_start_is_kept_unless_the_search_finds_better() -> None:
    """``start`` (a strategy per node: `api._refine` starts the unshared problem from the
    shared answer) is the search's first incumbent, so even one node returns no worse; a start
    that is not a point of the problem (aliased nodes choosing apart, one over the memory
    budget) is ignored, not an error."""
    problem = memory_bound_dag(30, 3)
    exact = solve(problem)
    assert solve(problem, max_nodes=1).objective > exact.objective   # without the start
    assert solve(problem, max_nodes=1, start=exact.choices).objective == exact.objective
    tight = dataclasses.replace(problem, memory_budget=min_memory(problem) * (1 + 1e-9))
    assert solve(tight, max_nodes=1, start=exact.choices).objective >= solve(tight).objective
    toy = xla_toy()   # nodes 1 and 4 are aliased: a start choosing them apart is ignored
    assert solve(toy, start=(0, 0, 0, 0, 1)).objective == solve(toy).objective


def test_highs_solves_on_one_thread_so_forked_workers_can_solve(monkeypatch) -> None:
    """HiGHS keeps its worker threads in a process-wide scheduler that a forked child inherits
    without the threads: after a multi-threaded solve in the parent, a solve in a forked
    stage-costing worker waits forever (seen on a 16-core GPU machine, where HiGHS's default
    is 8 threads). Every solve asks for one thread, and a forked child's solve then ends."""
    import multiprocessing
    import highspy
    asked: list[tuple[str, object]] = []

    class Recording(highspy.Highs):
        def setOptionValue(self, name, value):   # noqa: N802 (HiGHS's name)
            asked.append((name, value))
            return super().setOptionValue(name, value)

    monkeypatch.setattr(highspy, "Highs", Recording)
    problem = memory_bound_dag(12, 0)
    expected = solve(problem, solver="highs").choices
    assert ("threads", 1) in asked
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(solve, (problem,), {"solver": "highs"}).get(timeout=60)
    assert got.choices == expected


def test_an_accept_searchs_first_nodes_turn_off_the_presolve_rules_of_each_highs_version(
        monkeypatch) -> None:
    """An ``accept`` search (the planner's pricing and whole-stage solves: mostly their root)
    turns off the aggregator, parallel rows and columns, sparsify and probing: bits of HiGHS's
    rule enum, which moved as HiGHS added rules, so each version gets those rules' bits in its
    own enum and none of another rule's. The installed HiGHS accepts the mask; any other
    search keeps every rule (a long search gains from probing); each reaches the optimum."""
    import highspy
    from meshplan.planner.intra.ilp_backends import _presolve_rules_off
    bits = lambda mask: {b for b in range(32) if mask >> b & 1}   # noqa: E731
    assert bits(_presolve_rules_off((1, 15))) == {12, 13, 14, 15}
    assert bits(_presolve_rules_off((1, 12))) == {12, 13, 14, 15}
    assert bits(_presolve_rules_off((1, 11))) == {12, 13, 14}     # probing at 14, no sparsify
    assert bits(_presolve_rules_off((1, 7))) == {12, 13}
    statuses: list[object] = []

    class Recording(highspy.Highs):
        def setOptionValue(self, name, value):   # noqa: N802 (HiGHS's name)
            status = super().setOptionValue(name, value)
            if name == "presolve_rule_off":
                statuses.append((value, status))
            return status

    monkeypatch.setattr(highspy, "Highs", Recording)
    problem = memory_bound_dag(24, 5)   # one whose root does not find the optimum
    exact = solve(problem, solver="highs")
    assert solve(problem, solver="highs", max_nodes=10**6).objective == exact.objective
    assert statuses == []
    accepted = solve(problem, solver="highs", max_nodes=10**6, accept=(1, 0.0))
    h = highspy.Highs()
    assert statuses == [(_presolve_rules_off((h.versionMajor(), h.versionMinor())),
                         highspy.HighsStatus.kOk)]      # the accept search only
    assert accepted.objective == exact.objective and accepted.gap == 0.0


def test_a_gated_saving_on_a_tree_keeps_the_lp_relaxation_integral() -> None:
    """A gated hidden second (a weight's gather, hidden only while the weight is not ZeRO's)
    is the product of two nodes' choices. Bounded over their joint choice
    (`ilp_model._build_gate_cols`), a problem whose nodes form a tree keeps an integral LP
    relaxation, as its edges alone do; bounded by the marginals (``z <= M (1 - gate)``) a
    fractional mix of the gate node paid for seconds no integral plan gets, and HiGHS
    branched: a Wide-ResNet's intra-only ILP took 26.8 s instead of 8.9."""
    rng = random.Random(7)
    for _ in range(150):
        kv, kg, ku = rng.randint(2, 4), 2, rng.randint(2, 3)
        seconds = tuple(float(rng.choice((0, 1, 3, 10))) for _ in range(kv))
        costs = tuple(tuple(float(rng.randint(0, 12)) for _ in range(k)) for k in (kv, kg, ku))
        edge = IlpEdge(2, 0, tuple(tuple(float(rng.randint(0, 6)) for _ in range(kv))
                                   for _ in range(ku)))
        # A window wider than any hidden sum: the saving is the gated seconds themselves.
        term = OverlapTerm(tuple((0.0,) * k for k in (kv, kg, ku)),
                           tuple((20.0,) * k for k in (kv, kg, ku)), 1.0,
                           gated=((0, 1, (rng.randrange(kg),), seconds),))
        problem = IlpProblem(costs, (edge,), overlap=(term,))
        relaxed = solve(problem, lp_first=True)
        assert relaxed.solver == "highs:lp", problem
        assert relaxed.objective == pytest.approx(brute_force(problem)[0], abs=1e-9)


def test_a_probe_with_a_cutoff_tells_better_none_and_undecided() -> None:
    """``solve(..., cutoff, max_nodes, search_on=False)``: an assignment within the cutoff
    found in the nodes is returned; none proved to exist raises IlpCutOffError; the node
    limit reached with neither, NodeLimitError (not a proof, so not IlpCutOffError, and no
    search on unlimited)."""
    problem = memory_bound_dag(30, 3)   # its root does not find the optimum
    exact = solve(problem).objective
    probe = dict(max_nodes=1, search_on=False)
    with pytest.raises(NodeLimitError):
        solve(problem, cutoff=exact, **probe)
    assert solve(problem, cutoff=exact, max_nodes=10**6, search_on=False).objective == exact
    with pytest.raises(IlpCutOffError):
        solve(problem, cutoff=0.99 * exact, max_nodes=10**6, search_on=False)
    assert solve(problem, cutoff=2 * exact, **probe).objective <= 2 * exact


def test_rounding_residues_in_the_costs_are_zero_for_the_backend() -> None:
    """Costs 1e-16 of the largest (a price less an equal one) are below what HiGHS tells from
    zero, and stalled its simplex for a minute on one of MoE-10B's stage probes: the model it
    is handed has them zero, and the plans are the brute force's optimum all the same."""
    from meshplan.planner.intra.ilp_backends import _COST_NOISE, _normalize_costs
    rng = random.Random(7)
    checked = 0
    for _ in range(30):
        problem = random_problem(rng)
        residues = tuple(rng.choice((0.0, 3e-23, 1e-21)) for _ in problem.node_costs[0])
        noisy = dataclasses.replace(problem, node_costs=(residues, *problem.node_costs[1:]),
                                    memory_budget=None, max_cost=None)
        best = brute_force(noisy)
        if best is None or math.isinf(best[0]):
            continue
        scaled = _normalize_costs(build_model(reduce_for_costs(noisy)))
        assert not np.any((scaled.cost != 0) & (np.abs(scaled.cost) < _COST_NOISE))
        assert solve(noisy).objective == pytest.approx(best[0], rel=1e-9, abs=1e-12)
        checked += 1
    assert checked >= 10
