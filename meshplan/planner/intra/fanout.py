"""Operand costs charged once per value and once per parameter, not once per edge (fan-out).

A value read by several consumers is moved once per distinct resharding recipe: consumers that
need it in the same layout with the same gradient marks share the moved tensor, so its forward
collectives and its backward all-reduce run once, on the gradients summed locally (Megatron's
q, k and v projections read one layer-norm output and all-reduce its gradient once). A parameter
read by several ops (a tied embedding) is synchronized once per distinct set of axes its uses
leave its gradient partial over (see `param_sync`).

Each use of a value, at a pair of root choices ``(p, q)``, yields *charges* ``(unit, key,
cost)``: ``("move", value, recipe)`` costs the recipe's collectives; ``("sync", param, mode,
layout, axes)`` the update-phase synchronization over ``axes`` of a parameter kept in that
layout and mode; ``("sfb", param, axes, gather steps)`` the gathered
factors and whole-batch gradient of a weight under sufficient-factor broadcasting (`sfb.py`).
A key is paid once however many uses need it. A key that only one pair of roots
can need is a function of that pair's choices and stays in the pairwise matrices of Alpa's
eq. 1 (deduplicated per cell); a key several pairs can need becomes one `SharedCost`.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from meshplan.ir.graph import Graph, Node
from meshplan.planner.intra.ilp_problem import SharedCost
from meshplan.planner.intra.layout import Axes, Layout
from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import LogicalMesh
from meshplan.planner.intra.op_costs import (OpCosts, dp_axes, local_bytes, recipe_cost,
                                             sync_cost, zero_counts)
from meshplan.planner.intra.reshard import Recipe, reshard
from meshplan.planner.intra.sfb import applies, factor_gathers

Charge = tuple[Hashable, tuple, float]   # (unit, key, cost)
Use = tuple[str, int]                    # (consumer node, operand position)


def operand_uses(graph: Graph) -> dict[str, list[Use]]:
    """Every use of every value, in graph order: value -> [(consumer, operand position)]."""
    out: dict[str, list[Use]] = defaultdict(list)
    for node in graph.nodes:
        for j, name in enumerate(node.inputs):
            out[name].append((node.name, j))
    return out


def use_charges(costs: OpCosts, node: Node, j: int, p: int, q: int) -> list[Charge] | None:
    """What reading operand ``j`` of ``node`` costs when its producer's root picks ``p`` and the
    node's root ``q``; None when the pair is forbidden (a parameter resharded before a use)."""
    return _UseReader(costs, node, j).charges(p, q)


class _UseReader:
    """`use_charges` of one use (operand ``j`` of ``node``) at any pair of root choices: what
    every pair shares (the value, its parameter, the node's collective weights) looked up
    once, since a formulation prices hundreds of thousands of pairs."""

    def __init__(self, costs: OpCosts, node: Node, j: int) -> None:
        self.costs, self.node, self.j = costs, node, j
        self.u = costs.g.by_name[node.inputs[j]]
        self.param = costs.param_root.get(self.u.name)
        self.sources = costs.nc.choices[self.u.name]
        self.consumers = costs.nc.choices[node.name]
        self.weights = costs.ctx.weights_of(node.name)
        self.sfb = self.param is not None and self.param in costs.sfb and \
            costs.sfb[self.param].consumer == node.name
        # What every move of this use shares, numbered once: a move is then keyed by four
        # small things, not nine (the mesh's fields hashed at every pair).
        self.context = _context_id((self.u.out.nbytes, costs.shape, self.u.requires_grad,
                                    self.param is not None, costs.ctx.mesh, self.weights))

    def charges(self, p: int, q: int) -> list[Charge] | None:
        costs, u, param = self.costs, self.u, self.param
        strat = self.consumers[q].strategy
        src, dst, partial = self.sources[p].strategy.output, strat.inputs[self.j], \
            strat.grad_partial[self.j]
        key = (self.context, src, dst, partial)
        found = _MOVES.get(key)
        if found is None:
            found = _MOVES[key] = _moved(src, dst, partial, *_CONTEXTS[self.context])
        recipe, moved = found
        if param is not None and recipe.steps and not costs.ctx.param_reshard:
            # A parameter is computed with in the layout it is kept in (its spec); keeping it
            # in another layout is what the ZeRO-3 update mode is for.
            return None
        if self.sfb and costs.nc.choices[param][p].mode == "sfb":
            return sfb_charges(costs, self.node, self.j, p, q, recipe, param)
        out: list[Charge] = []
        if recipe.steps:
            out.append((("v", u.name), ("move", u.name, recipe), moved))
        if recipe.sync_axes:
            choice = costs.nc.choices[param][p]
            lay = choice.strategy.output
            nbytes = local_bytes(costs.g.by_name[param], lay, costs.shape)
            zero = zero_counts(choice.mode, costs.ctx, costs.g.by_name[param].kept is not False) \
                if choice.mode != "replicated" else ()
            out.append((("p", param), ("sync", param, choice.mode, lay, recipe.sync_axes),
                        sync_cost(choice.mode, recipe.sync_axes, nbytes, costs.ctx.mesh, zero,
                                  bucketed=costs.ctx.device is not None)))
        return out


# Moves by (context number, source layout, destination layout, gradient's partial axes), and
# the contexts by number (`_context_id`): for the process's life, as the caches of the cost
# functions below them are.
_MOVES: dict[tuple, tuple[Recipe, float]] = {}
_CONTEXTS: list[tuple] = []
_CONTEXT_IDS: dict[tuple, int] = {}


_NUMBERING = threading.Lock()   # plans made on several threads number contexts apart


def _context_id(context: tuple) -> int:
    """``context``'s number in `_CONTEXTS`, given at its first sight."""
    with _NUMBERING:
        found = _CONTEXT_IDS.get(context)
        if found is None:
            found = _CONTEXT_IDS[context] = len(_CONTEXTS)
            _CONTEXTS.append(context)
        return found


def _moved(src: Layout, dst: Layout, grad_partial: Axes, nbytes: int, shape: tuple[int, ...],
           needs_grad: bool, param: bool, mesh: LogicalMesh, weights: tuple[float, float]
           ) -> tuple[Recipe, float]:
    """The recipe moving a value from ``src`` to ``dst`` and its collectives' cost."""
    recipe = reshard(src, dst, nbytes, shape, grad_partial, needs_grad, param)
    return recipe, recipe_cost(recipe, needs_grad, mesh, weights)


def sfb_charges(costs: OpCosts, node: Node, j: int, p: int, q: int, recipe: Recipe,
                param: str) -> list[Charge] | None:
    """The weight operand ``j`` of ``node`` under SFB: its factors gathered in every backward
    and the gradient product over the whole batch (`sfb.py`); None where the consumer's
    strategy does not let SFB apply."""
    strat = costs.nc.choices[node.name][q].strategy
    dp = dp_axes(costs.nc.choices[param][p].strategy.output, costs.shape)
    if not applies(strat.inputs[j], recipe.sync_axes, dp, bool(recipe.steps)):
        return None
    act = costs.g.by_name[node.inputs[1 - j]]
    steps = factor_gathers(strat.inputs[1 - j], act.out.nbytes, strat.output, node.out.nbytes,
                           costs.shape)
    gathers = sum(collective_cost("all_gather", costs.ctx.mesh, s.axes, s.nbytes)
                  for s in steps)
    key = ("sfb", param, recipe.sync_axes, steps)
    return [(("p", param), key,
             costs.ctx.microbatches * gathers + costs.sfb_extra_s(node, strat.work_axes))]


def operand_cost(costs: OpCosts, node: Node, j: int, p: int, q: int) -> float:
    """The cost of one use on its own, as if no other use shared it (greedy baselines)."""
    charges = use_charges(costs, node, j, p, q)
    return math.inf if charges is None else math.fsum(c for _, _, c in charges)


def units_of(costs: OpCosts, value: str) -> list[Hashable]:
    units: list[Hashable] = [("v", value)]
    if value in costs.param_root:
        units.append(("p", costs.param_root[value]))
    return units


@dataclass
class OperandCharges:
    """Operand costs for the ILP: additions to root costs, edge matrices and shared costs."""

    node_costs: dict[str, list[float]]
    edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    shared: list[tuple[float, tuple]] = field(default_factory=list)  # (cost, blocks by root)

    def add(self, a: str, r: str, p: int, q: int, cost: float) -> None:
        if a == r:
            self.node_costs[r][p] += cost
        else:
            self.edges[(a, r)][p][q] += cost


def charge_operands(costs: OpCosts) -> OperandCharges:
    """Charge every operand use once per key (see the module docstring)."""
    nc, g = costs.nc, costs.g
    out = OperandCharges({r: [0.0] * len(nc.choices[r]) for r in nc.roots})
    uses = operand_uses(g)
    unit_uses: dict[Hashable, int] = defaultdict(int)
    for value, value_uses in uses.items():
        for unit in units_of(costs, value):
            unit_uses[unit] += len(value_uses)
    pending: dict[Hashable, list[tuple[str, str, int, int, tuple, float]]] = defaultdict(list)
    for node in g.nodes:
        r = nc.root_of[node.name]
        for j, name in enumerate(node.inputs):
            a = nc.root_of[name]
            if a != r and (a, r) not in out.edges:
                out.edges[(a, r)] = [[0.0] * len(nc.choices[r]) for _ in nc.choices[a]]
            src, dst = _use_classes(costs, node, j, len(nc.choices[a]), len(nc.choices[r]))
            # Classes numbered once: a pair's key is two ints, not two layouts hashed again.
            src_ids, dst_ids, width = _class_ids(src), _class_ids(dst), len(dst)
            memo: dict[int, list[Charge] | None] = {}
            reader = _UseReader(costs, node, j)
            for p, q in _pairs(a, r, len(nc.choices[a]), len(nc.choices[r])):
                k = src_ids[p] * width + dst_ids[q]
                charges = memo.get(k, _UNSEEN)
                if charges is _UNSEEN:
                    charges = memo[k] = reader.charges(p, q)
                if charges is None:
                    out.add(a, r, p, q, math.inf)
                    continue
                for unit, key, cost in charges:
                    if unit_uses[unit] == 1:
                        out.add(a, r, p, q, cost)
                    elif cost > 0:
                        pending[unit].append((a, r, p, q, key, cost))
    for entries in pending.values():
        _charge_unit(out, entries)
    return out


_UNSEEN = object()   # a memo's miss (None is a forbidden pair's charges)


def _class_ids(classes: list[Hashable]) -> list[int]:
    """Each class numbered by first appearance."""
    ids: dict[Hashable, int] = {}
    return [ids.setdefault(c, len(ids)) for c in classes]


def _use_classes(costs: OpCosts, node: Node, j: int, num_a: int, num_r: int
                 ) -> tuple[list[Hashable], list[Hashable]]:
    """What `use_charges` of operand ``j`` depends on, per producer-root index (the value's
    layout; a parameter's update mode and layout) and per consumer-root index (the layout the
    operand is consumed in, its gradient's partial axes): pairs of equal classes cost the same,
    so each class pair is priced once."""
    nc, name = costs.nc, node.inputs[j]
    param = costs.param_root.get(name)
    src: list[Hashable] = []
    for p in range(num_a):
        c = nc.choices[name][p]
        if param is not None:
            pc = nc.choices[param][p]
            src.append((c.strategy.output, pc.mode, pc.strategy.output))
        else:
            src.append(c.strategy.output)
    dst: list[Hashable] = []
    # An SFB weight's charge depends on the consumer's whole strategy (the factors' layouts).
    whole = param is not None and param in costs.sfb and costs.sfb[param].consumer == node.name
    for q in range(num_r):
        s = nc.choices[node.name][q].strategy
        dst.append(s if whole else (s.inputs[j], s.grad_partial[j]))
    return src, dst


def _pairs(a: str, r: str, num_a: int, num_r: int) -> list[tuple[int, int]]:
    if a == r:  # a follower in its producer's tree: one index for both
        return [(p, p) for p in range(num_a)]
    return [(p, q) for p in range(num_a) for q in range(num_r)]


def _charge_unit(out: OperandCharges, entries: list[tuple[str, str, int, int, tuple, float]]
                 ) -> None:
    """Keys of one unit: a key needed through one pair of roots only is paid in that pair's
    matrix (once per cell); a key several pairs can need becomes one shared cost."""
    ends: dict[tuple, set[tuple[str, str]]] = defaultdict(set)
    for a, r, _, _, key, _ in entries:
        ends[key].add((a, r))
    cells: dict[tuple[str, str, int, int], dict[tuple, float]] = defaultdict(dict)
    by_key: dict[tuple, dict[tuple[str, str, int], set[int]]] = defaultdict(
        lambda: defaultdict(set))
    cost_of: dict[tuple, float] = {}
    for a, r, p, q, key, cost in entries:
        if len(ends[key]) == 1:
            cells[(a, r, p, q)][key] = cost
        else:
            by_key[key][(a, r, p)].add(q)
            cost_of[key] = cost
    for (a, r, p, q), keys in cells.items():
        out.add(a, r, p, q, math.fsum(keys.values()))
    for key, key_cells in by_key.items():
        out.shared.append((cost_of[key], _blocks(key_cells)))


def _blocks(cells: dict[tuple[str, str, int], set[int]]) -> tuple:
    """Blocks (by root name) of one key: "the producer picks p, and some consumer picks one of
    the choices needing the key at p" -- producer choices with the same consumer clause merged;
    a consumer inside the producer's tree needs only the producer's choice."""
    same: dict[str, set[int]] = defaultdict(set)
    across: dict[tuple[str, int], dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for (a, r, p), qs in cells.items():
        if a == r:
            same[a].add(p)
        else:
            across[(a, p)][r].update(qs)
    merged: dict[tuple[str, tuple], list[int]] = defaultdict(list)
    for (a, p), by_root in across.items():
        clause = tuple(sorted((r, tuple(sorted(qs))) for r, qs in by_root.items()))
        merged[(a, clause)].append(p)
    blocks = [(((a, tuple(sorted(ps))),),) for a, ps in same.items()]
    blocks += [(((a, tuple(sorted(ps))),), clause) for (a, clause), ps in merged.items()]
    return tuple(blocks)


def shared_costs(out: OperandCharges, index: dict[str, int]) -> tuple[SharedCost, ...]:
    """The shared costs with roots replaced by their ILP node indices."""
    return tuple(SharedCost(cost, tuple(tuple(tuple((index[root], ps) for root, ps in clause)
                                              for clause in block) for block in blocks))
                 for cost, blocks in out.shared)


def param_sync(use_axes: Sequence[Axes]) -> tuple[Axes, tuple[Axes, ...]]:
    """How a parameter whose uses leave its gradient partial over ``use_axes`` (one entry per
    use, ``()`` for a use computed whole) is synchronized: ``(update_axes, backward_axes)``.

    The update phase synchronizes over ``update_axes``, the set with the most axes (first in use
    order on ties). Every other distinct non-empty set is all-reduced in backward on its own
    uses' contribution (``backward_axes``); and every use whose set is not ``update_axes`` has its
    contribution divided by the size of the ``update_axes`` group, because once complete it is
    summed again, identical, over that group. Each distinct set is thus one collective, which is
    what the ILP charges (`use_charges`).
    """
    keys = list(dict.fromkeys(a for a in use_axes if a))
    if not keys:
        return (), ()
    update = max(keys, key=len)
    return update, tuple(k for k in keys if k != update)
