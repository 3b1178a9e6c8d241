"""Interchangeable leaves tied (`ilp_reduce.interchangeable_leaves`, ``IlpProblem.tie_leaves``):
the same optimum as untied without a memory budget, a feasible restriction under one, and
`min_memory` bounded as `solve` ties (a budget at the least memory stays feasible).

Random problems built around copies: a hub with identical leaves (a mixture of experts' expert
weights on their op), the hub and its leaves repeated and aliased as blocks are, other nodes,
edges and overlap terms drawn at random, some of the latter on leaves (which must then not be
tied)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import replace

import pytest

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp import (IlpEdge, IlpProblem, OverlapTerm, evaluate, min_memory,
                                        solve)
from meshplan.planner.intra.ilp_reduce import interchangeable_leaves
from test_ilp import brute_force


def _row(rng: random.Random, k: int, top: int) -> tuple[float, ...]:
    return tuple(float(rng.randint(0, top)) for _ in range(k))


def copies_problem(rng: random.Random, budget: bool) -> IlpProblem:
    """Hubs 0 (and 1, its alias, in half the problems), each with the same leaves; two other
    nodes joined at random."""
    k = rng.randint(2, 3)
    leaf_cost, leaf_mem = _row(rng, k, 9), _row(rng, k, 6)
    matrix = tuple(tuple(float(rng.randint(0, 12) * (p != q)) for q in range(3))
                   for p in range(k))
    hubs = 2 if rng.random() < 0.5 else 1
    leaves_per_hub = rng.randint(2, 3) if hubs == 2 else rng.randint(2, 4)
    counts = [3] * hubs + [k] * (hubs * leaves_per_hub) + [rng.randint(1, 3), rng.randint(1, 3)]
    n = len(counts)
    node_costs = [_row(rng, c, 20) for c in counts]
    memory = [_row(rng, c, 6) for c in counts]
    edges, aliases = [], []
    hub_cost = node_costs[0]
    for h in range(hubs):
        node_costs[h] = hub_cost
        for j in range(leaves_per_hub):
            leaf = hubs + h * leaves_per_hub + j
            node_costs[leaf], memory[leaf] = leaf_cost, leaf_mem
            edges.append(IlpEdge(leaf, h, matrix))
            if h:
                aliases.append((hubs + j, leaf))
    if hubs == 2:
        aliases.append((0, 1))
    if rng.random() < 0.3:   # one leaf a little dearer: not interchangeable
        leaf = rng.randrange(hubs, hubs + hubs * leaves_per_hub)
        node_costs[leaf] = tuple(x + 1.0 for x in node_costs[leaf])
    others = (n - 2, n - 1)
    for _ in range(rng.randint(1, 4)):
        u = rng.choice(others)
        v = rng.choice([*range(hubs), others[0] if u == others[1] else others[1]])
        edges.append(IlpEdge(u, v, tuple(_row(rng, counts[v], 15) for _ in range(counts[u]))))

    def term() -> OverlapTerm:
        hidden = [[0.0] * c for c in counts]
        window = [list(_row(rng, c, 12)) if v in (0, *others) else [0.0] * c
                  for v, c in enumerate(counts)]
        hidden[0] = list(_row(rng, 3, 6 if rng.random() < 0.5 else 0))
        if rng.random() < 0.5:   # seconds on a leaf: it is in the term
            leaf = rng.randrange(hubs, hubs + hubs * leaves_per_hub)
            hidden[leaf] = list(_row(rng, k, 30))
        return OverlapTerm(tuple(map(tuple, hidden)), tuple(map(tuple, window)), 1.0,
                           in_order=rng.random() < 0.5)
    overlap = tuple(term() for _ in range(rng.choice((0, 1, 1))))
    return IlpProblem(tuple(node_costs), tuple(edges), tuple(aliases), tuple(memory),
                      live_sets=(tuple(range(n)),) if budget else (),
                      memory_budget=float(rng.randint(15, 40)) if budget else None,
                      overlap=overlap, tie_leaves=True)


def problems(seed: int, budget: bool) -> Iterator[tuple[IlpProblem, tuple]]:
    """40 problems of `copies_problem` and their ties."""
    rng = random.Random(seed)
    for _ in range(40):
        problem = copies_problem(rng, budget)
        yield problem, interchangeable_leaves(problem)


def test_tied_leaves_keep_the_optimum_without_a_budget() -> None:
    tied = 0
    for problem, ties in problems(7, budget=False):
        tied += bool(ties)
        for a, b in ties:   # only equal leaves are tied
            assert problem.node_costs[a] == problem.node_costs[b]
        sol = solve(problem)
        assert sol.objective == pytest.approx(brute_force(problem)[0], abs=1e-6), problem
        assert all(sol.choices[a] == sol.choices[b] for a, b in ties)
    assert tied >= 25, tied


def test_under_a_budget_ties_restrict_and_least_memory_agrees() -> None:
    restricted = 0
    for problem, ties in problems(11, budget=True):
        best = brute_force(problem)
        least = min_memory(problem)
        assert least >= best[1] - 1e-9
        # A budget at the least memory the ties allow is met (the planner's fallback).
        at_least = solve(replace(problem, memory_budget=least * (1 + 1e-9)))
        assert all(at_least.choices[a] == at_least.choices[b] for a, b in ties)
        if math.isinf(best[0]):
            continue
        try:
            sol = solve(problem)
        except InfeasibleIlpError:   # the ties exclude every assignment within the budget
            restricted += 1
            continue
        assert sol.objective >= best[0] - 1e-6
        assert sol.objective == pytest.approx(sum(evaluate(problem, sol.choices)))
        restricted += sol.objective > best[0] + 1e-6
    assert restricted < 20, restricted


def test_the_final_refine_unties_what_a_budget_made_dearer() -> None:
    """`api._refine` searches the problem without ties from the tied answer: where mixing
    identical leaves fits a faster plan under the budget, the plan is the untied optimum.
    Problems without block aliases (which `_refine` drops as well), of seeds that hold such
    budgets."""
    from meshplan.api import _refine
    mended = 0
    for seed in (22, 23, 25):
        for problem, ties in problems(seed, budget=True):
            best = brute_force(problem)
            if not ties or problem.aliases or math.isinf(best[0]):
                continue
            try:
                tied = solve(problem)
            except InfeasibleIlpError:
                continue
            refined = _refine(problem, tied)
            assert refined.objective == pytest.approx(best[0], abs=1e-6), problem
            mended += refined.objective < tied.objective - 1e-6
    assert mended >= 3, mended
