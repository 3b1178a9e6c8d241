"""Best-first search for the cheapest strategy assignment of a strategy-choice problem: HAP's
program synthesis (§4.3) as an A* over partial programs, on the problem the ILP also solves.

A partial program has decided the strategies of the first ``k`` decision variables, in an order
where every variable comes after its producers and a source (a parameter or an input: HAP's
Placeholder-Shard and Parameter-Shard) right before its first consumer — HAP's first
search-time optimization, fusing triples with empty preconditions into their consumers, so a
source's placement is never enumerated. Its *properties* are the layouts of the decided values
some undecided variable still depends on (an edge, a shared fan-out cost or a tied block);
every other decided layout is dropped — HAP's third optimization, removing redundant
properties — so two partial programs with the same properties are the same search state and
only the cheaper one is kept (dominance pruning; with a memory budget, only one that is
cheaper *and* uses no more memory prunes another). Communication is decided with its consumer
and paid once (the edge and fan-out costs), which is HAP's second optimization: a value is
never sent twice the same way.

The score of a partial program is its cost so far plus a lower bound on the rest: for each
undecided variable, the cheapest of its strategies counting each edge to an earlier variable
at the cheapest entry of that strategy's column (`_Space.least_step`). It never
overestimates and never drops by more than a step costs, so A* returns a proven optimum at the
first complete program it takes from the queue — an exact solver, checked against the ILP.
Equal scores go deeper first, which crosses the plateaus of equal-cost layouts quickly.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp import PLAN_MAX_NODES, PLAN_REL_GAP, solve
from meshplan.planner.intra.ilp_reduce import merge_aliases
from meshplan.planner.intra.ilp_problem import IlpProblem, IlpSolution, evaluate, peak_memory


class SearchLimitError(RuntimeError):
    """The search took more states than allowed (the problem is too tangled for A*)."""


@dataclass(frozen=True)
class SearchStats:
    """What the search did: states taken from the queue and generated, the largest property
    set, and which solver proved the program optimal."""

    expanded: int
    generated: int
    widest_state: int
    # "ilp" when memory bound and the states ran out (`_within_budget`), "astar+ilp" when
    # the problem overlaps communication with compute (A*'s answer then starts the ILP)
    solver: str = "astar"


def synthesize(problem: IlpProblem, order: Sequence[int] | None = None, *,
               max_states: int = 2_000_000, memory_bound: bool = False
               ) -> tuple[IlpSolution, SearchStats]:
    """The optimal assignment of ``problem`` by A* (module docstring). ``order``: the nodes in
    an order where producers come first (default: index order); sources are moved before their
    first consumer. ``memory_bound``: a search of a like problem found the budget binding
    (the loop's previous round): go to the ILP at once. Raises InfeasibleIlpError when no assignment is allowed (or fits the
    memory budget and ``max_cost``), SearchLimitError past ``max_states`` generated states."""
    t0 = time.perf_counter()
    space = _Space(problem, list(range(problem.num_nodes)) if order is None else list(order))
    # ``gap``: 0 where A* answers (it proves its optimum); an ILP may stop at `PLAN_MAX_NODES`
    if memory_bound and space.budget is not None:
        choices, gap = _ilp(problem)
        stats = SearchStats(0, 0, 0, solver="ilp")
    else:
        choices, gap, stats = _within_budget(space, max_states)
    if problem.overlap and stats.solver == "astar":
        # The overlap's saving (`OverlapTerm`) is a minimum over the whole program, which no
        # path cost prices: A*'s answer, optimal without it, starts the ILP that has it.
        choices, gap = _ilp(problem, start=choices)
        stats = replace(stats, solver="astar+ilp")
    node, edge = evaluate(problem, choices)
    if problem.max_cost is not None and node + edge > problem.max_cost * (1 + 1e-9):
        raise InfeasibleIlpError(f"the cheapest assignment costs {node + edge:.6g}, above "
                                 f"max_cost {problem.max_cost:.6g}")
    sol = IlpSolution(choices, node + edge, node, edge, space.num_vars, len(problem.edges),
                      time.perf_counter() - t0, "astar", gap)
    return sol, stats


def _ilp(problem: IlpProblem, start: tuple[int, ...] | None = None
         ) -> tuple[tuple[int, ...], float]:
    """The ILP's answer and its gap: the planner's solves stop at `PLAN_MAX_NODES` (a
    budget-bound program often has its answer at the root and then spends minutes on the
    proof's last fraction of a per cent)."""
    sol = solve(problem, start=start, rel_gap=PLAN_REL_GAP, max_nodes=PLAN_MAX_NODES)
    return sol.choices, sol.gap


def _within_budget(space: "_Space", max_states: int
                   ) -> tuple[tuple[int, ...], float, SearchStats]:
    """Memory first relaxed: the cheapest program, if it fits, is the answer (HAP's search has
    no memory at all). Else the exact search with memory in the states (a state prunes another
    only when no worse in cost and in memory); trading cost against memory multiplies the
    states, and past 20 000 of them the problem goes to the ILP, which takes the
    memory rows in stride: on BERT-MoE over HAP's 64 GPUs HiGHS proves the optimum in 0.4 s,
    where a memory penalty searched by bisection took 11 s of A* for a program 16 % dearer."""
    budget = space.budget
    choices, stats = space.search(max_states, with_memory=False)
    if budget is None or space.peak(choices) <= budget * (1 + 1e-9):
        return choices, 0.0, stats
    try:
        choices, stats = space.search(min(max_states, 20_000), with_memory=True)
        return choices, 0.0, stats
    except SearchLimitError:
        pass
    choices, gap = _ilp(space.p)
    return choices, gap, SearchStats(stats.expanded, stats.generated, stats.widest_state,
                                     solver="ilp")


class _Space:
    """The problem as decision variables in search order: tied nodes are one variable."""

    def __init__(self, problem: IlpProblem, order: list[int]) -> None:
        self.p = problem
        n = problem.num_nodes
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must list every node 0..{n - 1} once")
        group = merge_aliases(n, problem.aliases)
        pos = {v: i for i, v in enumerate(_sources_first(problem, order))}
        groups: dict[int, list[int]] = {}
        for v in sorted(range(n), key=pos.__getitem__):
            groups.setdefault(int(group[v]), []).append(v)
        members = sorted(groups.values(), key=lambda g: pos[g[0]])
        self.var_of = [0] * n
        for i, g in enumerate(members):
            for v in g:
                self.var_of[v] = i
        self.members = members
        self.num_vars = len(members)
        k = problem.num_strategies
        self.cost = [[math.fsum(problem.node_costs[v][p] for v in g) for p in range(k[g[0]])]
                     for g in members]
        # Edges between variables, each charged when its later end is decided.
        self.edges_at: list[list[tuple[int, tuple[tuple[float, ...], ...], bool]]] = [
            [] for _ in members]
        last_use = list(range(self.num_vars))
        for e in problem.edges:
            a, b = self.var_of[e.u], self.var_of[e.v]
            if a == b:
                for p in range(len(self.cost[a])):
                    self.cost[a][p] += e.costs[p][p]
                continue
            late, early = max(a, b), min(a, b)
            # Stored as (earlier variable, matrix, whether rows belong to the later one).
            self.edges_at[late].append((early, e.costs, a == late))
            last_use[early] = max(last_use[early], late)
        self.shared_at: list[list[int]] = [[] for _ in members]
        for i, term in enumerate(problem.shared):
            vs = {self.var_of[v] for block in term.blocks for clause in block
                  for v, _ in clause}
            late = max(vs)
            self.shared_at[late].append(i)
            for v in vs:
                last_use[v] = max(last_use[v], late)
        self.last_use = last_use
        # Per earlier variable: its edges to later ones, with the later end's column minima
        # (what `least_step` counted for them before the earlier end was decided).
        self.later: list[list[tuple[int, tuple, bool, list[float]]]] = [[] for _ in members]
        for v, entries in enumerate(self.edges_at):
            for early, costs, rows_late in entries:
                mins = [min(costs[q]) if rows_late else min(row[q] for row in costs)
                        for q in range(len(self.cost[v]))]
                self.later[early].append((v, costs, rows_late, mins))
        self.least = [self.least_step(i) for i in range(self.num_vars)]
        self.floor = [0.0] * (self.num_vars + 1)
        for i in reversed(range(self.num_vars)):
            self.floor[i] = self.floor[i + 1] + min(self.least[i])
        self._memory_setup()

    def least_step(self, i: int) -> list[float]:
        """Per strategy of variable ``i``, the least its decision can cost: its own cost and,
        per edge to an earlier variable, the cheapest entry of its column (whatever the
        earlier one chose). Summed over the undecided variables, a lower bound of the rest."""
        out = list(self.cost[i])
        for _, costs, rows_late in self.edges_at[i]:
            for q in range(len(out)):
                out[q] += min(costs[q]) if rows_late else min(row[q] for row in costs)
        return out

    def _memory_setup(self) -> None:
        p = self.p
        self.budget = p.memory_budget if p.live_sets else None
        if self.budget is None:
            return
        mem = p.node_memory
        assert mem is not None
        self.sets = [set(live) for live in p.live_sets]
        # Per variable and set: bytes each strategy adds (a tied variable adds all members').
        self.mem = [[[math.fsum(mem[v][q] for v in g if v in live)
                      for q in range(len(self.cost[i]))] for live in self.sets]
                    for i, g in enumerate(self.members)]
        work = p.node_working
        self.work = [[max((work[v][q] for v in g), default=0.0) if work else 0.0
                      for q in range(len(self.cost[i]))] for i, g in enumerate(self.members)]
        self.mem_floor = [[0.0] * len(self.sets) for _ in range(self.num_vars + 1)]
        for i in reversed(range(self.num_vars)):
            self.mem_floor[i] = [f + min(m) for f, m in zip(self.mem_floor[i + 1], self.mem[i])]

    def peak(self, choices: tuple[int, ...]) -> float:
        return peak_memory(self.p, choices)

    def search(self, max_states: int, *, with_memory: bool
               ) -> tuple[tuple[int, ...], SearchStats]:
        """A* (module docstring); ``with_memory`` keeps every live set within the budget."""
        counter = itertools.count()
        with_memory = with_memory and self.budget is not None
        start_mem = (0.0,) * len(self.sets) if with_memory else ()
        # Queue entries: (score, -depth, tiebreak, cost, depth, props, memory, working, path).
        queue: list = [(self.floor[0], 0, next(counter), 0.0, 0, (), start_mem, 0.0, None)]
        seen: dict[tuple, list[tuple[float, tuple[float, ...], float]]] = {}
        expanded = generated = widest = 0
        while queue:
            _, _, _, cost, k, props, memory, working, path = heapq.heappop(queue)
            if k == self.num_vars:
                return self._assignment(path), SearchStats(expanded, generated, widest)
            expanded += 1
            chosen = dict(props)
            for q, base in enumerate(self.cost[k]):
                step = base + self._edges(k, q, chosen)
                if math.isinf(step):
                    continue
                new_mem, new_work = memory, working
                if with_memory:
                    new_mem = tuple(m + add[q] for m, add in zip(memory, self.mem[k]))
                    new_work = max(working, self.work[k][q])
                    if any(m + f + new_work > self.budget * (1 + 1e-9)
                           for m, f in zip(new_mem, self.mem_floor[k + 1])):
                        continue
                chosen[k] = q
                step += self._shared(k, chosen)
                new_props = tuple((v, c) for v, c in chosen.items() if self.last_use[v] > k)
                del chosen[k]
                total = cost + step
                key = (k + 1, new_props)
                if self._dominated(seen, key, total, new_mem, new_work):
                    continue
                generated += 1
                if generated > max_states:
                    raise SearchLimitError(
                        f"program synthesis passed {max_states} states on a problem of "
                        f"{self.num_vars} decisions; plan this model with the ILP (method "
                        "'intra-only') or raise max_states")
                widest = max(widest, len(new_props))
                score = total + self.floor[k + 1] + self._pending(k + 1, new_props)
                heapq.heappush(queue, (score, -(k + 1), next(counter),
                                       total, k + 1, new_props, new_mem, new_work, (q, path)))
        raise InfeasibleIlpError("no strategy assignment is allowed" + (
            f" within the memory budget of {self.budget:.4g} bytes" if self.budget else ""))

    def _pending(self, k: int, props: tuple) -> float:
        """How much more than their floor the undecided variables fed by decided ones must
        pay: each one's cheapest strategy with those edges at the entries the decided ends
        chose (still a lower bound, per variable, so the sum stays admissible)."""
        vecs: dict[int, list[float]] = {}
        for u, p in props:
            for v, costs, rows_late, mins in self.later[u]:
                if v < k:
                    continue
                vec = vecs.get(v)
                if vec is None:
                    vec = vecs[v] = list(self.least[v])
                for q in range(len(vec)):
                    if math.isfinite(mins[q]):   # else vec[q] is already inf
                        vec[q] += (costs[q][p] if rows_late else costs[p][q]) - mins[q]
        return math.fsum(min(vec) - min(self.least[v]) for v, vec in vecs.items())

    def _edges(self, k: int, q: int, chosen: dict[int, int]) -> float:
        total = 0.0
        for early, costs, rows_late in self.edges_at[k]:
            p = chosen[early]
            total += costs[q][p] if rows_late else costs[p][q]
        return total

    def _shared(self, k: int, chosen: dict[int, int]) -> float:
        if not self.shared_at[k]:
            return 0.0
        picks = _Picks(self.var_of, chosen)
        return math.fsum(self.p.shared[i].cost for i in self.shared_at[k]
                         if self.p.shared[i].holds(picks))  # type: ignore[arg-type]

    @staticmethod
    def _dominated(seen: dict, key: tuple, cost: float, memory: tuple[float, ...],
                   working: float) -> bool:
        """Whether a kept state with ``key`` is no worse in every respect; else keep this one
        (and forget the ones it beats)."""
        kept = seen.setdefault(key, [])
        for c, m, w in kept:
            if c <= cost and w <= working and all(a <= b for a, b in zip(m, memory)):
                return True
        kept[:] = [(c, m, w) for c, m, w in kept
                   if not (cost <= c and working <= w and all(b <= a for a, b in zip(m, memory)))]
        kept.append((cost, memory, working))
        return False

    def _assignment(self, path: tuple | None) -> tuple[int, ...]:
        picks: list[int] = []
        while path is not None:
            picks.append(path[0])
            path = path[1]
        picks.reverse()
        out = [0] * self.p.num_nodes
        for var, q in enumerate(picks):
            for v in self.members[var]:
                out[v] = q
        return tuple(out)


class _Picks:
    """``choices[node]`` for `SharedCost.holds`, read from the decided variables."""

    def __init__(self, var_of: list[int], chosen: dict[int, int]) -> None:
        self.var_of, self.chosen = var_of, chosen

    def __getitem__(self, node: int) -> int:
        return self.chosen[self.var_of[node]]


def _sources_first(problem: IlpProblem, order: list[int]) -> list[int]:
    """``order`` with every node that consumes nothing (no incoming edge) moved right before
    the first node it feeds."""
    rank = {v: i for i, v in enumerate(order)}
    has_input = {e.v for e in problem.edges}
    first_use: dict[int, int] = {}
    for e in problem.edges:
        if e.u not in has_input:
            first_use[e.u] = min(first_use.get(e.u, rank[e.v]), rank[e.v])
    return sorted(order, key=lambda v: (first_use.get(v, rank[v]) - 0.5 if v in first_use
                                        else rank[v], rank[v]))
