"""Random valid plans: the ILP's own feasible set, explored by solving it under random costs.

Every strategy assignment the ILP allows (no forbidden pair, aliases kept, every parameter in a
layout its uses can read) is a plan meshplan may one day choose on some cluster; each must train
exactly like one device. Solving the real problem with random node, edge and shared costs picks
such an assignment at random, with update modes included when a memory budget opens them.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import meshplan.api as api
from meshplan.plan.plan import Plan
from meshplan.planner.intra.ilp import evaluate, solve
from meshplan.planner.intra.ilp_problem import IlpEdge, IlpProblem, SharedCost

# A budget no test model comes near: ZeRO-2/3 become choices without ever binding.
OPEN_BUDGET_GB = 1e6


def randomize(problem: IlpProblem, rng: random.Random) -> IlpProblem:
    """The same feasible set with random finite costs (forbidden entries stay forbidden)."""
    def pick(x: float) -> float:
        return math.inf if math.isinf(x) else rng.random()

    return dataclasses.replace(
        problem,
        node_costs=tuple(tuple(pick(x) for x in row) for row in problem.node_costs),
        edges=tuple(IlpEdge(e.u, e.v, tuple(tuple(pick(x) for x in row) for row in e.costs))
                    for e in problem.edges),
        shared=tuple(SharedCost(rng.random(), t.blocks) for t in problem.shared),
        memory_budget=None, live_sets=())


def random_plan(model: Any, loss_fn: Any, optimizer: Any, example_batch: Any,
                shape: tuple[int, int], seed: int, monkeypatch: Any, *,
                abstract: bool = False, sfb: str | None = None, **step: Any) -> Plan:
    """A plan of ``model`` on a ``shape`` mesh whose strategies are a random valid assignment.

    Its ``objective`` is what the real problem charges for that assignment. ``abstract``: α=β=1
    units and no memory budget (replicated updates only); else the cluster's own costs with a
    budget that never binds, so ZeRO-2/3 updates are drawn too. ``step``: the training step's
    options (micro-batches, recomputation, dtype).
    """
    rng = random.Random(seed)

    def random_solve(problem: IlpProblem, **kw: Any) -> Any:
        # Random costs make the MIP hard to prove optimal; any feasible point is as random:
        # the first the search finds, the same on any machine (a time limit gave another
        # plan on a slower one, and 7 s proofs where no point came within it).
        # Not from the planner's start (`api._refine` starts from the tied plan): the first
        # point would be that start, and no random plan would untie a block's repeats.
        kw.pop("start", None)
        sol = solve(randomize(problem, rng), first_found=True, **kw)
        node, edge = evaluate(problem, sol.choices)
        return dataclasses.replace(sol, objective=node + edge, node_cost=node, edge_cost=edge)

    units = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0), "memory_budget_gb": 0} if abstract \
        else {"memory_budget_gb": OPEN_BUDGET_GB}
    monkeypatch.setattr(api, "solve", random_solve)
    monkeypatch.setattr(api, "plan_solve", random_solve)
    try:
        return api.plan(model, loss_fn, optimizer, example_batch,
                        f"local:{shape[0] * shape[1]}", mesh_shape=shape, share_blocks=False,
                        name=f"random-{seed}", sfb=sfb, **units, **step)
    finally:
        monkeypatch.undo()
