"""Time the intra-op ILP on HiGHS (highspy) vs scipy.optimize.milp, MIP vs LP-first, and the
marginal edge form vs McCormick, on random problems shaped like real sharding problems.

Usage: .venv/bin/python benchmarks/ilp_solvers.py [--sizes 500 1000 3000] [--repeats 3]
                                                  [--shapes chain dag] [--mccormick-max 1000]

Problems: nodes in topological order; a chain (edge v-1 -> v) or a DAG (plus a skip edge from a
recent node with probability 0.3, ~1.3 edges per node). A node has 4-40 strategies (mostly few,
some many); each strategy has an output sharding spec and an input spec per operand, drawn from
the 9 specs of a 2-D tensor on a 2x4 mesh. Resharding cost = alpha-beta cost of turning the
producer's output spec into the consumer's input spec: 0 on the diagonal and for pure slicing,
all-gathers otherwise. Some strategies pay an all-reduce; ~15 % of nodes alias (follow) their
producer. Memory = tensor bytes / shards; live sets from activation liveness; the budget sits
halfway between the smallest achievable peak and the peak of the unconstrained optimum, so it
binds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp import (IlpEdge, IlpProblem, evaluate, min_memory,
                                        peak_memory, reduce_for_costs, solve)
from meshplan.planner.intra.ilp_backends import run_model
from meshplan.planner.intra.ilp_model import MemorySpec, build_model, extract_choices

MESH = (2, 4)
ALPHA, BETA = (1e-5, 1e-5), (1e-10, 4e-11)  # s, s/byte: axis 1 is the fast one
SPECS = ((), (0,), (1,), (0, 1))  # mesh axes a tensor dim is split over
SPEC_PAIRS = tuple((a, b) for a in SPECS for b in SPECS if not set(a) & set(b))  # 9 specs
STRATEGY_COUNTS = (4, 4, 4, 6, 8, 8, 9, 12, 16, 24, 40)


def shards(spec: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    """Number of pieces a tensor is cut into under ``spec``."""
    return int(np.prod([MESH[a] for dim in spec for a in dim])) if any(spec) else 1


def reshard_cost(src: int, dst: int, num_bytes: float) -> float:
    """alpha-beta cost (s) of converting spec ``src`` into ``dst``: 0 when only slicing."""
    a, b = SPEC_PAIRS[src], SPEC_PAIRS[dst]
    cost, size = 0.0, num_bytes / shards(a)
    for dim_src, dim_dst in zip(a, b):
        for axis in dim_src:
            if axis not in dim_dst:  # this split must be undone: all-gather over the axis
                size *= MESH[axis]
                cost += ALPHA[axis] + BETA[axis] * size * (MESH[axis] - 1) / MESH[axis]
    return cost


def transition_table(num_bytes: float) -> np.ndarray:
    """9x9 resharding costs for one tensor size."""
    n = len(SPEC_PAIRS)
    return np.array([[reshard_cost(i, j, num_bytes) for j in range(n)] for i in range(n)])


def make_problem(num_nodes: int, shape: str, seed: int) -> IlpProblem:
    """A random sharding-like problem without memory budget (see module docstring)."""
    rng = np.random.default_rng(seed)
    counts, out_specs, in_specs, sizes, aliases = [], [], [], [], []
    preds: list[list[int]] = [[] for _ in range(num_nodes)]
    for v in range(num_nodes):
        if v > 0:
            preds[v].append(v - 1)
        if shape == "dag" and v > 2 and rng.random() < 0.3:
            preds[v].append(int(rng.integers(max(0, v - 20), v - 1)))
        follower = v > 0 and rng.random() < 0.15
        k = counts[v - 1] if follower else int(rng.choice(STRATEGY_COUNTS))
        counts.append(k)
        out_specs.append(_draw_specs(rng, k))
        in_specs.append({u: np.where(rng.random(k) < 0.5, out_specs[v], _draw_specs(rng, k))
                         for u in preds[v]})
        sizes.append(float(rng.choice([2**20, 2**22, 2**24, 2**26])))
        if follower:
            aliases.append((v - 1, v))
    node_costs = tuple(_node_costs(rng, out_specs[v], sizes[v]) for v in range(num_nodes))
    tables = {s: transition_table(s) for s in set(sizes)}
    edges = tuple(IlpEdge(u, v, _matrix(tables[sizes[u]][np.ix_(out_specs[u], in_specs[v][u])]))
                  for v in range(num_nodes) for u in preds[v])
    memory = tuple(tuple(sizes[v] / shards(SPEC_PAIRS[s]) for s in out_specs[v])
                   for v in range(num_nodes))
    return IlpProblem(node_costs, edges, tuple(aliases), memory, _live_sets(preds))


def _draw_specs(rng: np.random.Generator, k: int) -> np.ndarray:
    n = len(SPEC_PAIRS)
    return rng.permutation(n)[:k] if k <= n else rng.integers(0, n, size=k)


def _node_costs(rng: np.random.Generator, specs: np.ndarray, size: float) -> tuple[float, ...]:
    all_reduce = ALPHA[1] + BETA[1] * 2 * size / shards(SPEC_PAIRS[0]) * 3 / 4
    return tuple(float(all_reduce / shards(SPEC_PAIRS[s]) * rng.integers(1, 4))
                 if rng.random() < 0.4 else 0.0 for s in specs)


def _matrix(block: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in block)


def _live_sets(preds: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """At step t: every node produced at or before t whose last consumer runs at or after t."""
    last_use = list(range(len(preds)))
    for v, ps in enumerate(preds):
        for u in ps:
            last_use[u] = max(last_use[u], v)
    return tuple(tuple(u for u in range(max(0, t - 20), t + 1) if last_use[u] >= t)
                 for t in range(len(preds)))


def with_binding_budget(problem: IlpProblem) -> IlpProblem:
    """Set the budget halfway between the smallest peak and the free optimum's peak."""
    low = min_memory(problem)
    high = peak_memory(problem, solve(problem).choices)
    return IlpProblem(problem.node_costs, problem.edges, problem.aliases, problem.node_memory,
                      problem.live_sets, (low + high) / 2)


@dataclass(frozen=True)
class Outcome:
    """What one run reports: objective, how it ended, gap left, model size."""

    objective: float
    how: str
    gap: float
    num_variables: int
    num_constraints: int


@dataclass(frozen=True)
class Config:
    """One way of solving: a label, a time limit (s) and a function running it."""

    label: str
    time_limit_s: float
    run: Callable[[IlpProblem, float], Outcome]
    with_budget: bool = True


def _solve_config(solver: str, lp_first: bool) -> Callable[[IlpProblem, float], Outcome]:
    def run(problem: IlpProblem, time_limit_s: float) -> Outcome:
        sol = solve(problem, solver=solver, lp_first=lp_first, time_limit_s=time_limit_s)
        return Outcome(sol.objective, sol.solver, sol.gap, sol.num_variables,
                       sol.num_constraints)
    return run


def _mccormick(problem: IlpProblem, time_limit_s: float) -> Outcome:
    reduced = reduce_for_costs(problem)
    memory = None
    if problem.memory_budget is not None and problem.node_memory is not None:
        memory = MemorySpec(tuple(np.asarray(r) for r in problem.node_memory),
                            problem.live_sets, problem.memory_budget)
    model = build_model(reduced, memory=memory, edge_form="mccormick")
    raw = run_model(model, solver="highs", lp_first=False, time_limit_s=time_limit_s)
    objective = sum(evaluate(problem, extract_choices(reduced, model, raw.x)))
    return Outcome(objective, raw.how, raw.gap, model.num_cols, model.num_rows)


CONFIGS = (Config("highs mip", 300.0, _solve_config("highs", False)),
           Config("highs lp-first", 300.0, _solve_config("highs", True)),
           Config("scipy mip", 300.0, _solve_config("scipy", False)),
           Config("scipy lp-first", 300.0, _solve_config("scipy", True)),
           Config("highs mccormick", 60.0, _mccormick),
           Config("highs mip, no budget", 300.0, _solve_config("highs", False), False),
           Config("highs lp-first, no budget", 300.0, _solve_config("highs", True), False),
           Config("scipy mip, no budget", 300.0, _solve_config("scipy", False), False),
           Config("scipy lp-first, no budget", 300.0, _solve_config("scipy", True), False))


def time_config(config: Config, problem: IlpProblem, repeats: int) -> tuple[float, Outcome]:
    """Median wall time (s) of ``repeats`` runs and the last run's outcome."""
    times, outcome = [], Outcome(float("nan"), "", float("nan"), 0, 0)
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            outcome = config.run(problem, config.time_limit_s)
        except (InfeasibleIlpError, TimeoutError) as exc:
            outcome = Outcome(float("nan"), type(exc).__name__, float("nan"), 0, 0)
        times.append(time.perf_counter() - start)
        if outcome.gap > 0:
            break  # hit the time limit: repeating would only burn the same time again
    return statistics.median(times), outcome


def cell(median: float, outcome: Outcome) -> str:
    """Table cell: median seconds, flagged when the time limit stopped the search."""
    if outcome.gap > 0:
        return f">{median:.0f} s (gap {100 * outcome.gap:.0f} %)"
    return f"{median:.2f} s ({outcome.how.split(':')[1]})" if ":" in outcome.how else \
        f"{median:.2f} s"


def describe(problem: IlpProblem, outcome: Outcome) -> str:
    """Nodes, edges, strategies, resharding pairs and the model size after reductions."""
    pairs = sum(int(np.isfinite(np.asarray(e.costs)).sum()) for e in problem.edges)
    return (f"{len(problem.edges)} edges, {sum(problem.num_strategies)} strategies, "
            f"{pairs} pairs -> {outcome.num_variables} vars, {outcome.num_constraints} rows")


def _agreement(values: list[float]) -> str:
    agree = "agree" if np.allclose(values, values[0], rtol=1e-9) else "DIFFER"
    return f"{values[0]:.6g} ({agree})"


def main() -> None:
    """Run the benchmark and print a markdown table of median times."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 3000])
    parser.add_argument("--shapes", nargs="+", default=["chain", "dag"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mccormick-max", type=int, default=1000,
                        help="skip McCormick above this many nodes (it is much slower)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only configs whose label contains one of these strings")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if args.only is None or any(o in c.label for o in args.only)]
    labels = [c.label for c in configs]
    print("| problem | size | " + " | ".join(labels) + " | objective (budget / none) |")
    print("|---|---|" + "---|" * (len(labels) + 1))
    for shape in args.shapes:
        for size in args.sizes:
            problem = with_binding_budget(make_problem(size, shape, args.seed + size))
            cells, first = [], None
            exact: dict[bool, list[float]] = {True: [], False: []}
            for config in configs:
                if config.label == "highs mccormick" and size > args.mccormick_max:
                    cells.append("skipped")
                    continue
                instance = problem if config.with_budget else dataclasses.replace(
                    problem, memory_budget=None)
                median, outcome = time_config(config, instance, args.repeats)
                cells.append(cell(median, outcome))
                first = first or outcome
                if outcome.gap == 0:
                    exact[config.with_budget].append(outcome.objective)
            objective = " / ".join(_agreement(values) for values in exact.values() if values)
            print(f"| {shape} {size} | {describe(problem, first)} | " + " | ".join(cells)
                  + f" | {objective} |", flush=True)

if __name__ == "__main__":
    main()
