"""Shared (fan-out) costs in the ILP: paid once when any block holds, exact against brute force."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp import IlpEdge, IlpProblem, evaluate, solve
from meshplan.planner.intra.ilp_problem import SharedCost
from test_ilp import SOLVER_CONFIGS, brute_force, random_problem


def random_shared(rng: random.Random, counts: tuple[int, ...]) -> tuple[SharedCost, ...]:
    terms = []
    for _ in range(rng.randint(1, 4)):
        blocks = []
        for _ in range(rng.randint(1, 3)):
            clauses = []
            for _ in range(rng.randint(1, 2)):
                nodes = rng.sample(range(len(counts)), rng.randint(1, min(3, len(counts))))
                clauses.append(tuple((v, tuple(sorted(rng.sample(range(counts[v]),
                                                                 rng.randint(1, counts[v])))))
                                     for v in nodes))
            blocks.append(tuple(clauses))
        terms.append(SharedCost(float(rng.randint(1, 40)), tuple(blocks)))
    return tuple(terms)


@pytest.mark.parametrize("solver,lp_first", SOLVER_CONFIGS)
def test_shared_costs_match_brute_force(solver: str, lp_first: bool | None) -> None:
    rng = random.Random(77)
    solved = 0
    for _ in range(60):
        base = random_problem(rng)
        problem = dataclasses.replace(base, shared=random_shared(rng, base.num_strategies))
        expected = brute_force(problem)
        if expected is None or math.isinf(expected[0]):
            with pytest.raises(InfeasibleIlpError):
                solve(problem, solver=solver, lp_first=lp_first)
            continue
        sol = solve(problem, solver=solver, lp_first=lp_first)
        assert sol.objective == pytest.approx(expected[0], abs=1e-6), problem
        solved += 1
    assert solved >= 20


def test_a_shared_cost_is_paid_once_for_all_its_edges() -> None:
    # One value read by three consumers: each consumer computes for 9 in layout 0, or for free in
    # layout 1, into which the value must be moved for 10 -- once, however many consumers
    # want it. Charged per edge (30) the move would lose to 27; shared, it wins at 10.
    move = SharedCost(10.0, ((((0, (1,)), (1, (1,)), (2, (1,))),),))
    problem = IlpProblem(node_costs=((9.0, 0.0), (9.0, 0.0), (9.0, 0.0)), shared=(move,))
    sol = solve(problem)
    assert sol.choices == (1, 1, 1) and sol.objective == 10.0
    assert sum(evaluate(problem, (1, 0, 0))) == 28.0


def test_shared_cost_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="finite"):
        SharedCost(math.inf, ((((0, (0,)),),),))
    with pytest.raises(ValueError, match="no blocks"):
        SharedCost(1.0, ())
    with pytest.raises(ValueError, match="clauses"):
        SharedCost(1.0, (((),),))
    with pytest.raises(ValueError, match="strategies"):
        IlpProblem(node_costs=((0.0,),), shared=(SharedCost(1.0, ((((0, (3,)),),),)),))
    with pytest.raises(ValueError, match="edges"):  # unrelated checks still run
        IlpProblem(node_costs=((0.0,), (0.0,)), edges=(IlpEdge(0, 1, ((0.0, 1.0),)),))


def test_a_clause_naming_two_aliased_nodes_solves_with_highs() -> None:
    """Aliased nodes share their variables, so a clause naming both puts two entries in one
    (row, column) of the model; HiGHS 1.15 never finished presolving such a matrix. The
    backend sums them: the solve ends, with the brute-force optimum."""
    from meshplan.planner.intra.ilp import reduce_for_costs
    from meshplan.planner.intra.ilp_backends import _to_csc
    from meshplan.planner.intra.ilp_model import build_model

    # Found by the random test below (seed 77, second problem): 2 aliased nodes, 4 shared costs.
    inf = math.inf
    problem = IlpProblem(
        node_costs=((1.0, 7.0), (12.0, 18.0)),
        edges=(IlpEdge(1, 0, ((0.0, 3.0), (13.0, 0.0))), IlpEdge(1, 0, ((0.0, 2.0), (inf, 0.0))),
               IlpEdge(0, 1, ((0.0, inf), (3.0, 0.0))), IlpEdge(1, 0, ((0.0, 24.0), (28.0, 0.0)))),
        aliases=((0, 1),),
        shared=(SharedCost(30.0, ((((1, (1,)), (0, (0,))), ((1, (0,)),)), (((0, (1,)),),),
                                  (((0, (1,)), (1, (1,))),))),
                SharedCost(37.0, ((((1, (1,)),),), (((1, (0,)),), ((1, (0,)),)),
                                  (((0, (0,)), (1, (0, 1))), ((0, (0, 1)), (1, (1,)))))),
                SharedCost(19.0, ((((1, (0,)),), ((1, (0, 1)), (0, (1,)))),
                                  (((0, (0, 1)),), ((1, (0, 1)), (0, (0, 1)))))),
                SharedCost(32.0, ((((1, (0, 1)), (0, (0, 1))),),))))
    model = build_model(reduce_for_costs(problem))
    start, index, value = _to_csc(model)
    pairs = [(c, int(r)) for c in range(model.num_cols) for r in index[start[c]:start[c + 1]]]
    assert len(pairs) == len(set(pairs)) < len(model.rows)   # a duplicate existed and was summed
    assert value.sum() == model.vals.sum()
    for solver in ("highs", "scipy"):
        assert solve(problem, solver=solver).objective == brute_force(problem)[0] == 131.0
