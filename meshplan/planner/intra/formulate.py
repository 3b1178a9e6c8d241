"""Costs of node choices and the ILP they form (Alpa eq. 1 over roots).

For every root r and index p: ``node_costs[r][p]`` sums, over r and its followers, the compute
time of each op (roofline, forward + backward; left out when costs are in abstract α/β units)
and the resharding between a follower and its operand inside the same tree. For every operand
whose producer lies in another tree, ``edges[(a, b)][p][q]`` is the resharding cost from the
producer's layout at p to the layout the consumer needs at q, forward and backward
(`reshard.py`), plus, for a parameter, the update-phase gradient synchronization its update mode
implies. A parameter's own index pays its update: the optimizer's pass over its local shard
(`OpCosts.update_cost`). A value with several consumers is charged once per distinct recipe, a
parameter once per synchronization (`fanout.py`): pairwise when that is a function of two roots'
choices, else as shared costs. Memory per root index: parameter, gradient and optimizer bytes by
update mode, and the activations kept for backward. The costs themselves come from
`op_costs.py`; the solver is in `ilp.py`; this module only assembles numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from meshplan.ir.graph import Graph
from meshplan.planner.intra.blocks import repeated_blocks
from meshplan.planner.intra.choices import NodeChoices
from meshplan.planner.intra.fanout import charge_operands, shared_costs
from meshplan.planner.intra.ilp_problem import IlpEdge, IlpProblem
# The cost evaluator lives in op_costs.py; its names are part of this module's interface.
from meshplan.planner.intra.op_costs import (CostContext, OpCosts, dp_axes,  # noqa: F401
                                             is_kept, local_bytes, param_roots, recipe_cost,
                                             step_cost, sync_cost)
from meshplan.planner.intra.overlap_terms import overlap_terms


@dataclass
class Formulation:
    """An ILP over the roots of `choices`, and how to read its indices back."""

    choices: NodeChoices
    ctx: CostContext
    roots: list[str]
    problem: IlpProblem


def renamed(form: Formulation, graph: Graph, singled_out: frozenset[str] = frozenset()
            ) -> Formulation | None:
    """``form`` naming the nodes of ``graph`` instead of its own program's, where the two
    differ in nothing a formulation reads but names: node k of one is node k of the other,
    alike in every field but its name, its operands' names and its state name, and each is
    in ``singled_out`` (the names options single out: replicated updates) when the other is.
    None where they differ otherwise. Stages of one structure in a pipeline (GPT-3's 72 of
    one or two blocks) so share one formulation instead of building one each."""
    old = form.choices.graph
    if old is graph:
        return form
    if len(old.nodes) != len(graph.nodes):
        return None
    names: dict[str, str] = {}
    for a, b in zip(old.nodes, graph.nodes):
        names[a.name] = b.name
        if replace(a, name=b.name, inputs=tuple(names.get(i, "") for i in a.inputs),
                   state_name=b.state_name) != b or (a.name in singled_out) != (
                       b.name in singled_out):
            return None
    if names.get(old.loss) != graph.loss:
        return None
    nc = form.choices
    choices = NodeChoices(graph, nc.mesh_shape,
                          {names[k]: names[v] for k, v in nc.root_of.items()},
                          {names[k]: v for k, v in nc.main_of.items()},
                          {names[k]: v for k, v in nc.choices.items()},
                          {names[k]: v for k, v in nc.batch_dims.items()})
    return replace(form, choices=choices, roots=[names[r] for r in form.roots])


def block_aliases(nc: NodeChoices, index: dict[str, int]) -> tuple[tuple[int, int], ...]:
    """ILP aliases tying each root of a repeated block to the same root of the first repeat."""
    nodes = nc.graph.nodes
    out = []
    for group in repeated_blocks(nc.graph):
        first = nodes[group[0]].name
        if first not in index:
            continue
        for i in group[1:]:
            other = nodes[i].name
            same = other in index and [c.strategy for c in nc.choices[other]] == [
                c.strategy for c in nc.choices[first]]
            if same:
                out.append((index[first], index[other]))
    return tuple(out)


def doubling_runs(aliases: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`block_aliases` loosened: each block's repeats but the last in runs of 1, 2, 4, 8, ...
    consecutive repeats, each run tied to its own first, and the last repeat free (it feeds
    what follows the blocks, a head). Any number of repeats can then take another plan (a
    subset of the runs sums to it), as mixing plans under a memory budget wants (k blocks
    lean, the rest fast), with log2 of the repeats' decisions: GPT-39B's 24 pairs of layers
    as 6 runs."""
    members: dict[int, list[int]] = {}
    for first, other in aliases:
        members.setdefault(first, [first]).append(other)
    out = []
    for repeats in members.values():
        body = repeats[:-1]
        for k in range(1, len(body).bit_length()):
            run = body[(1 << k) - 1:(1 << (k + 1)) - 1]
            out += [(run[0], v) for v in run[1:]]
    return tuple(out)


def formulate(nc: NodeChoices, ctx: CostContext, memory_budget: float | None, *,
              share_blocks: bool = False, layers: Mapping[str, int] | None = None
              ) -> Formulation:
    """Build the ILP of Alpa eq. 1 over the roots of ``nc`` (see the module docstring).
    ``share_blocks``: repeated blocks share their decisions (`blocks.py`). ``layers`` (each
    replayed node's segment, `planner/recompute.py`) under recomputation: the program is
    replayed segment by segment (layer by layer), so the budget holds for each segment's live
    set — the state, the values crossing into or out of a segment, what runs plainly, one
    segment's activations (`live_sets_by_layer`)."""
    costs = OpCosts(nc, ctx)
    roots = nc.roots
    index = {r: i for i, r in enumerate(roots)}
    operands = charge_operands(costs)
    node_costs = operands.node_costs
    memory = {r: [0.0] * len(nc.choices[r]) for r in roots}
    working = {r: [0.0] * len(nc.choices[r]) for r in roots}
    tie = ctx.tie_break
    for node in nc.graph.nodes:
        r = nc.root_of[node.name]
        row, held, work = node_costs[r], memory[r], working[r]
        # What a node can cost at all, asked once for its choices (a formulation has ~10^5
        # node choices, most of them views and elementwise ops that cost only compute).
        computes = ctx.device is not None and not node.is_source and node.flops != 0
        param = node.role == "param"
        syncs = node.sig is not None and node.sig.sync is not None
        holds = node.role in ("param", "buffer") or is_kept(node)
        for p, choice in enumerate(nc.choices[node.name]):
            if computes or param:
                row[p] += costs.compute_cost(node, choice) + costs.update_cost(node, choice)
            if syncs:
                row[p] += costs.stat_sync_cost(node, choice)
            if holds:
                mem = costs.memory(node, choice)
                held[p] += mem
                row[p] += tie * mem
            if param:
                work[p] = max(work[p], costs.working(node, choice))
    problem = IlpProblem(
        node_costs=tuple(tuple(node_costs[r]) for r in roots),
        edges=tuple(IlpEdge(index[a], index[r], tuple(tuple(row) for row in m))
                    for (a, r), m in operands.edges.items()),
        node_memory=tuple(tuple(memory[r]) for r in roots),
        node_working=tuple(tuple(working[r]) for r in roots)
        if any(any(w) for w in working.values()) else None,
        aliases=block_aliases(nc, index) if share_blocks else (),
        live_sets=() if memory_budget is None else
        live_sets_by_layer(nc, index, layers) if layers and ctx.recompute else
        (tuple(range(len(roots))),),
        memory_budget=memory_budget, shared=shared_costs(operands, index),
        overlap=overlap_terms(costs, nc, roots), tie_leaves=True)
    return Formulation(nc, ctx, roots, problem)


def live_sets_by_layer(nc: NodeChoices, index: dict[str, int], layers: Mapping[str, int]
                       ) -> tuple[tuple[int, ...], ...]:
    """What a program replayed segment by segment holds at once, one set per segment (root
    indices): parameters and buffers, the values crossing into or out of a segment (kept for
    the replay), the values running plainly (``layers`` lacks them: kept as usual), and the
    segment's own values (replayed). A root counts in its own node's segment."""
    g = nc.graph
    seg = layers.get
    state = {r for r in index if g.by_name[r].role in ("param", "buffer")}
    crossing = {nc.root_of[i] for n in g.nodes for i in n.inputs
                if seg(n.name) != seg(i) and (seg(n.name) is not None or seg(i) is not None)}
    everyone = state | crossing | {r for r in index if seg(r) is None}
    out = []
    for layer in sorted({seg(r) for r in index} - {None}):
        out.append(tuple(sorted(index[r] for r in index
                                if r in everyone or seg(r) == layer)))
    return tuple(out) or (tuple(sorted(index.values())),)


def without_zero3(form: Formulation, problem: IlpProblem) -> IlpProblem:
    """``problem`` (of ``form``) with every ZeRO-3 choice forbidden: a partial recomputation
    does not run with it yet (`planner/recompute.py`)."""
    costs = tuple(tuple(math.inf if form.choices.choices[r][p].mode == "zero3" else x
                        for p, x in enumerate(row))
                  for r, row in zip(form.roots, problem.node_costs))
    return replace(problem, node_costs=costs)
