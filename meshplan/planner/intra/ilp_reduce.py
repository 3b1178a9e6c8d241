"""Exact reductions applied before the ILP is built; they shrink it without changing its optimum.

1. ``merge_aliases``: aliased nodes become one *group* with summed node costs, so they share
   one set of variables; an edge inside a group adds its diagonal to the group's costs.
2. ``merge_edges``: parallel edges between the same two groups are summed into one matrix.
3. ``propagate``: arc consistency and folding, repeated until nothing changes:
   - a strategy with no allowed partner across some edge is forbidden;
   - an edge with a fixed end (a group with one allowed strategy) becomes node costs on the
     other end;
   - an edge whose allowed block is separable, ``R[p, q] = a[p] + b[q]`` (all-zero included),
     becomes node costs ``a`` and ``b`` on its ends.
A group with no allowed strategy left proves the problem infeasible.
4. ``reduce_shared``: shared (fan-out) costs are restated over groups and their allowed
   strategies; a condition on a fixed group is true or false, so a block may drop out or make its
   cost a constant.

``interchangeable_leaves`` gives more aliases, for the problems that ask for them
(``IlpProblem.tie_leaves``): exact too where no memory budget binds, a restriction where one
does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from meshplan.errors import InfeasibleIlpError
from meshplan.planner.intra.ilp_problem import IlpProblem

EdgeKey = tuple[int, int]

# Relative tolerance for "R equals a[p] + b[q]": folding then moves the objective by at most
# this fraction of the edge's largest cost, far below any solver tolerance.
_SEPARABLE_RTOL = 1e-12


@dataclass(frozen=True, eq=False)
class ReducedIlp:
    """Groups of aliased nodes with pruned costs and the edges that still need variables.

    ``group_of_node[v]`` is node ``v``'s group; ``costs[g][p]`` the group's cost of strategy
    ``p`` with folded edges included (``inf`` = forbidden); ``edges`` join two free groups
    (more than one allowed strategy) as ``(gu, gv, R)`` with ``gu < gv``. ``shared`` holds each
    remaining shared cost as ``(cost, blocks)``, a block being ``((g, positions), ...)`` over free
    groups: a block is a tuple of clauses, a clause a tuple of ``(g, positions into allowed(g))``
    alternatives; ``shared_offset`` sums the shared costs paid whatever the choice.
    """

    group_of_node: np.ndarray
    costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    shared: tuple[tuple[float, tuple], ...] = ()
    shared_offset: float = 0.0

    def allowed(self, group: int) -> np.ndarray:
        """Indices of the group's allowed strategies."""
        return np.flatnonzero(np.isfinite(self.costs[group]))


def interchangeable_leaves(problem: IlpProblem) -> tuple[tuple[int, int], ...]:
    """Aliases tying leaves that are interchangeable: nodes of one edge each, to the same node
    with the same matrix, with the same costs, memory and working bytes, in no shared cost or
    overlap term (a mixture of experts' expert weights, 3 x 64 of them on each layer of
    DeepSeek-V2-Lite). Whatever the other nodes pick, each such leaf's best strategy is the
    same, so tying them keeps the optimum where no memory budget binds; under one it is a
    restriction (identical leaves may fit by mixing), as sharing blocks is. Aliased nodes are
    taken by their alias groups: a group of such leaves (an expert's weight in each repeat of
    a block) ties to a group of the same leaves, neighbours by their groups."""
    n = problem.num_nodes
    group = merge_aliases(n, problem.aliases)
    degree = np.zeros(n, dtype=np.int64)
    for e in problem.edges:
        degree[e.u] += 1
        degree[e.v] += 1
    busy = set()
    for term in problem.shared:
        busy.update(v for block in term.blocks for clause in block for v, _ in clause)
    for term in problem.overlap:
        busy.update(v for v in range(n) if any(term.hidden[v]) or any(term.window[v]))
        busy.update(x for v, g, _, _ in term.gated for x in (v, g))
        if term.ready is not None:
            busy.update(r for v, r in enumerate(term.ready) if r != v)
    memory, working = problem.node_memory, problem.node_working
    key: dict[int, tuple] = {}
    for e in problem.edges:
        for leaf, other, side in ((e.u, e.v, 0), (e.v, e.u, 1)):
            if degree[leaf] == 1 and leaf not in busy:
                key[leaf] = (int(group[other]), side, e.costs, problem.node_costs[leaf],
                             None if memory is None else memory[leaf],
                             None if working is None else working[leaf])
    members: dict[int, list[int]] = defaultdict(list)
    for v in range(n):
        members[int(group[v])].append(v)
    classes: dict[frozenset, list[int]] = defaultdict(list)
    for vs in members.values():
        if all(v in key for v in vs):
            kinds: dict[tuple, int] = defaultdict(int)
            for v in vs:
                kinds[key[v]] += 1
            classes[frozenset(kinds.items())].append(vs[0])
    return tuple((firsts[0], v) for firsts in classes.values() for v in firsts[1:])


def reduce_problem(node_costs: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]],
                   aliases: tuple[tuple[int, int], ...],
                   shared: tuple[tuple[float, tuple], ...] = ()) -> ReducedIlp:
    """Apply every reduction of the module docstring to validated arrays. ``shared`` lists
    ``(cost, blocks)`` as `SharedCost` states them, over nodes.

    Raises InfeasibleIlpError naming a node once some node has no allowed strategy left.
    """
    group_of_node = merge_aliases(len(node_costs), aliases)
    num_groups = int(group_of_node.max()) + 1
    costs = [np.zeros(0)] * num_groups
    for v, cost in enumerate(node_costs):
        g = group_of_node[v]
        costs[g] = cost.astype(np.float64) if costs[g].size == 0 else costs[g] + cost
    merged = merge_edges(edges, group_of_node, costs)
    first_node = np.unique(group_of_node, return_index=True)[1]
    propagate(costs, merged, first_node)
    kept = tuple((gu, gv, r) for (gu, gv), r in sorted(merged.items()))
    terms, offset = reduce_shared(shared, group_of_node, costs)
    return ReducedIlp(group_of_node, tuple(costs), kept, terms, offset)


def reduce_shared(shared: tuple[tuple[float, tuple], ...], group_of_node: np.ndarray,
                  costs: list[np.ndarray]) -> tuple[tuple, float]:
    """Shared costs over free groups (see ``ReducedIlp.shared``) and the always-paid total."""
    terms, offset = [], 0.0
    allowed: dict[int, np.ndarray] = {}   # per group, once: blocks name the same groups often
    for cost, blocks in shared:
        kept, always = [], False
        for block in blocks:
            conds = _reduce_block(block, group_of_node, costs, allowed)
            if conds is None:
                continue
            if not conds:
                always = True
                break
            kept.append(conds)
        if always:
            offset += cost
        elif kept and cost > 0:
            terms.append((cost, tuple(kept)))
    return tuple(terms), offset


def _reduce_block(block: tuple, group_of_node: np.ndarray, costs: list[np.ndarray],
                  allowed_of: dict[int, np.ndarray]
                  ) -> tuple[tuple[tuple[int, np.ndarray], ...], ...] | None:
    """A block's clauses over free groups, each a tuple of ``(group, positions into its allowed
    strategies)``; ``()`` when the block always holds, None when it never can.
    ``allowed_of`` caches each group's allowed strategies."""
    clauses = []
    for clause in block:
        wanted: dict[int, set[int]] = defaultdict(set)
        for v, strategies in clause:
            wanted[int(group_of_node[v])].update(strategies)
        alternatives, always = [], False
        for g, strategies in wanted.items():
            allowed = allowed_of.get(g)
            if allowed is None:
                allowed = allowed_of[g] = np.flatnonzero(np.isfinite(costs[g]))
            hit = _positions(allowed, strategies)
            if hit.size == 0:
                continue
            if allowed.size == 1:
                always = True
                break
            alternatives.append((g, hit))
        if always:
            continue
        if not alternatives:
            return None
        clauses.append(tuple(alternatives))
    return tuple(clauses)


def _positions(allowed: np.ndarray, strategies: set[int]) -> np.ndarray:
    """The positions in ``allowed`` (sorted) of the ``strategies`` it holds, increasing (what
    ``np.flatnonzero(np.isin(allowed, ...))`` gives, without its sort of both)."""
    wanted = np.fromiter(sorted(strategies), dtype=np.int64, count=len(strategies))
    at = np.searchsorted(allowed, wanted)
    inside = at < allowed.size
    at, wanted = at[inside], wanted[inside]
    return at[allowed[at] == wanted]


def merge_aliases(num_nodes: int, aliases: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Union-find over alias pairs; return each node's group id, numbered 0.. in node order."""
    parent = list(range(num_nodes))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in aliases:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = np.array([root(v) for v in range(num_nodes)], dtype=np.int64)
    return np.unique(roots, return_inverse=True)[1]


def merge_edges(edges: list[tuple[int, int, np.ndarray]], group_of_node: np.ndarray,
                costs: list[np.ndarray]) -> dict[EdgeKey, np.ndarray]:
    """Sum edges per unordered group pair (rows = smaller group); fold intra-group edges.

    Mutates ``costs`` (the working copy owned by ``reduce_problem``) for intra-group edges.
    """
    merged: dict[EdgeKey, np.ndarray] = {}
    for u, v, r in edges:
        gu, gv = int(group_of_node[u]), int(group_of_node[v])
        if gu == gv:
            costs[gu] = costs[gu] + np.diagonal(r)
            continue
        key, mat = ((gu, gv), r) if gu < gv else ((gv, gu), r.T)
        merged[key] = merged[key] + mat if key in merged else np.array(mat, dtype=np.float64)
    return merged


def propagate(costs: list[np.ndarray], edges: dict[EdgeKey, np.ndarray],
              first_node: np.ndarray) -> None:
    """Run arc consistency and edge folding to a fixed point, editing ``costs`` and ``edges``.

    Both arguments are working copies owned by ``reduce_problem``. Raises InfeasibleIlpError.
    """
    for g, cost in enumerate(costs):
        _check_alive(cost, g, first_node)
    incident: dict[int, set[EdgeKey]] = defaultdict(set)
    for key in edges:
        incident[key[0]].add(key)
        incident[key[1]].add(key)
    pending = list(edges)
    while pending:
        key = pending.pop()
        if key not in edges:
            continue
        changed = _visit_edge(key, costs, edges, first_node)
        if key not in edges:
            incident[key[0]].discard(key)
            incident[key[1]].discard(key)
        for g in changed:
            pending.extend(incident[g] - {key})


def _visit_edge(key: EdgeKey, costs: list[np.ndarray], edges: dict[EdgeKey, np.ndarray],
                first_node: np.ndarray) -> list[int]:
    """Prune, then fold the edge if possible; return groups whose allowed set shrank."""
    gu, gv = key
    r = edges[key]
    pair_ok = np.isfinite(r) & np.isfinite(costs[gu])[:, None] & np.isfinite(costs[gv])[None, :]
    changed = [g for g, keep in ((gu, pair_ok.any(axis=1)), (gv, pair_ok.any(axis=0)))
               if _restrict(costs, g, keep, first_node)]
    allowed_u, allowed_v = np.flatnonzero(np.isfinite(costs[gu])), np.flatnonzero(
        np.isfinite(costs[gv]))
    if allowed_u.size == 1 or allowed_v.size == 1:
        if allowed_u.size == 1:
            costs[gv] = costs[gv] + r[allowed_u[0], :]
            changed += [gv] if _now_smaller(costs[gv], allowed_v, gv, first_node) else []
        else:
            costs[gu] = costs[gu] + r[:, allowed_v[0]]
            changed += [gu] if _now_smaller(costs[gu], allowed_u, gu, first_node) else []
        del edges[key]
        return changed
    split = _separable(r[np.ix_(allowed_u, allowed_v)])
    if split is not None:
        a, b = split
        costs[gu] = costs[gu].copy()
        costs[gu][allowed_u] += a
        costs[gv] = costs[gv].copy()
        costs[gv][allowed_v] += b
        del edges[key]
    return changed


def _restrict(costs: list[np.ndarray], g: int, keep: np.ndarray, first_node: np.ndarray) -> bool:
    """Forbid the strategies of group ``g`` outside ``keep``; return whether any was allowed."""
    drop = np.isfinite(costs[g]) & ~keep
    if not drop.any():
        return False
    costs[g] = np.where(drop, np.inf, costs[g])
    _check_alive(costs[g], g, first_node)
    return True


def _now_smaller(cost: np.ndarray, before: np.ndarray, g: int, first_node: np.ndarray) -> bool:
    _check_alive(cost, g, first_node)
    return int(np.isfinite(cost).sum()) < before.size


def _check_alive(cost: np.ndarray, g: int, first_node: np.ndarray) -> None:
    if not np.isfinite(cost).any():
        raise InfeasibleIlpError(
            f"node {int(first_node[g])} (with its aliases) has no allowed strategy left: every "
            "strategy is forbidden by its own cost or by an edge's forbidden pairs")


def _separable(block: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Return ``(a, b)`` with ``block[p, q] == a[p] + b[q]`` when that holds, else None."""
    if not np.isfinite(block).all():
        return None
    a = block[:, 0]
    b = block[0, :] - block[0, 0]
    scale = max(1.0, float(np.abs(block).max()))
    if np.abs(block - a[:, None] - b[None, :]).max() > _SEPARABLE_RTOL * scale:
        return None
    return a, b
