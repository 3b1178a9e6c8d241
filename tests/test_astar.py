"""The A* program search is an exact solver of the ILP's problem: random problems against
brute force and HiGHS, and the zoo's formulations against the ILP."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.hetero.astar import SearchLimitError, synthesize
from meshplan.planner.intra.ilp import evaluate, peak_memory, solve
from meshplan.planner.intra.ilp_problem import IlpEdge, IlpProblem
from test_ilp import brute_force, random_problem
from test_ilp_shared import random_shared


def test_random_problems_match_brute_force() -> None:
    rng = random.Random(4321)
    checked = {"solved": 0, "infeasible": 0}
    for _ in range(150):
        problem = random_problem(rng)
        if rng.random() < 0.5:
            problem = dataclasses.replace(problem,
                                          shared=random_shared(rng, problem.num_strategies))
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            with pytest.raises(InfeasibleIlpError):
                synthesize(problem)
            checked["infeasible"] += 1
            continue
        sol, _ = synthesize(problem)
        assert sol.objective == pytest.approx(expected[0], abs=1e-9), problem
        assert sol.objective == pytest.approx(sum(evaluate(problem, sol.choices)))
        if problem.memory_budget is not None:
            assert peak_memory(problem, sol.choices) <= problem.memory_budget + 1e-9
        for a, b in problem.aliases:
            assert sol.choices[a] == sol.choices[b]
        checked["solved"] += 1
    assert checked["solved"] >= 60 and checked["infeasible"] >= 10, checked


def chain(n: int, k: int, seed: int) -> IlpProblem:
    """A long chain with a source per node (a layer's weight): the shape of a real model."""
    rng = random.Random(seed)
    costs = [tuple(float(rng.randint(0, 9)) for _ in range(k)) for _ in range(2 * n)]
    edges = []
    for i in range(n):
        op, weight = 2 * i, 2 * i + 1
        edges.append(IlpEdge(weight, op, tuple(tuple(float(rng.randint(0, 9) * (p != q))
                                                     for q in range(k)) for p in range(k))))
        if i:
            edges.append(IlpEdge(op - 2, op, tuple(tuple(float(rng.randint(0, 9) * (p != q))
                                                         for q in range(k)) for p in range(k))))
    # Weights first, as a traced program lists its parameters.
    order = [2 * i + 1 for i in range(n)] + [2 * i for i in range(n)]
    return IlpProblem(tuple(costs), tuple(edges)), order


def test_sources_move_to_their_consumers_so_a_long_chain_stays_narrow() -> None:
    problem, order = chain(300, 4, 5)
    sol, stats = synthesize(problem, order)
    assert sol.objective == pytest.approx(solve(problem).objective)
    assert stats.widest_state <= 2   # the previous op and a weight, never all 300 weights


def test_the_state_limit_is_a_clear_error() -> None:
    problem, order = chain(40, 4, 6)
    with pytest.raises(SearchLimitError, match="intra-only"):
        synthesize(problem, order, max_states=10)


def test_a_binding_budget_past_the_state_limit_goes_to_the_ilp() -> None:
    # Memory multiplies the states (cost and memory must both be dominated to prune); past
    # the limit the problem is the ILP's, which proves the optimum under the budget.
    rng = random.Random(11)
    problem, order = chain(60, 4, 7)
    memory = tuple(tuple(float(rng.randint(1, 9)) for _ in range(4)) for _ in range(120))
    free = synthesize(problem, order)[0]
    used = sum(memory[v][p] for v, p in enumerate(free.choices))
    tight = dataclasses.replace(problem, node_memory=memory, live_sets=(tuple(range(120)),),
                                memory_budget=used - 25.0)
    sol, stats = synthesize(tight, order, max_states=2_000)
    assert stats.solver == "ilp"
    assert sol.objective == pytest.approx(solve(tight).objective)
    assert peak_memory(tight, sol.choices) <= used - 25.0


def test_the_ilp_stops_at_the_planners_node_limit_and_says_how_far_it_may_be(monkeypatch
                                                                              ) -> None:
    # A budget-bound program often has its answer at the root and then spends minutes on the
    # proof (`ilp.PLAN_MAX_NODES`); stopped early, the solution carries the gap left.
    import meshplan.planner.hetero.astar as astar
    from meshplan.planner.intra.ilp import PLAN_REL_GAP
    rng = random.Random(12)
    problem, order = chain(60, 4, 7)
    memory = tuple(tuple(float(rng.randint(1, 9)) for _ in range(4)) for _ in range(120))
    used = sum(memory[v][p] for v, p in enumerate(synthesize(problem, order)[0].choices))
    tight = dataclasses.replace(problem, node_memory=memory, live_sets=(tuple(range(120)),),
                                memory_budget=used - 25.0)
    proved, stats = synthesize(tight, order, max_states=2_000)
    assert stats.solver == "ilp" and proved.gap <= PLAN_REL_GAP
    monkeypatch.setattr(astar, "PLAN_MAX_NODES", 1)
    stopped, _ = synthesize(tight, order, max_states=2_000)
    assert stopped.gap > PLAN_REL_GAP
    assert stopped.objective >= proved.objective * (1 - proved.gap) - 1e-9
    assert peak_memory(tight, stopped.choices) <= used - 25.0
