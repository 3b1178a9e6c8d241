"""Baseline planning methods as restrictions of the ILP's choices.

Each baseline keeps, for every root, only the choices its rule allows; the ILP then solves what
is left (often a single choice per root). So a baseline's plan is an ordinary plan: it runs, is
costed and is compared exactly like the ILP's own.

- ``heuristic`` (GSPMD-style sharding propagation): every batch input is split on its largest
  dim over all devices; then, in program order, each op takes the strategy that is cheapest
  given the layouts its operands already have (greedy, no look-ahead), and a parameter takes the
  layout its first consumer wants (a later use of it, e.g. a tied embedding, may reshard it).
- ``expert`` (DeepSpeed-style MoE): expert parameters (an expert dim first, named like
  ``*.moe.w_in``/``*.experts.*``) are split on that dim over all devices, or over the mesh axis
  whose size divides the expert count (`_expert_choice`); every other parameter is replicated
  and updated ZeRO-2; the batch is split over all devices.
"""

from __future__ import annotations

import re
from dataclasses import replace

from meshplan.planner.intra.choices import Choice, NodeChoices
from meshplan.planner.intra.fanout import operand_cost
from meshplan.planner.intra.op_costs import CostContext, OpCosts
from meshplan.planner.intra.layout import Layout, active_axes

EXPERT_PARAM = re.compile(r"(^|\.)(moe\.(w_in|w_out|b_in|b_out)|experts?\.[^.]+)$")


def restrict(nc: NodeChoices, keep: dict[str, list[int]]) -> NodeChoices:
    """``nc`` with each listed root (and its followers, index for index) cut to ``keep[root]``."""
    out = replace(nc, choices=dict(nc.choices))
    for node in nc.graph.nodes:
        root = nc.root_of[node.name]
        if root in keep:
            out.choices[node.name] = [nc.choices[node.name][i] for i in keep[root]]
    return out


def _all_axes_on(ndim: int, dim: int, shape: tuple[int, int]) -> Layout:
    dims: list[tuple[int, ...]] = [()] * ndim
    dims[dim] = active_axes(shape)
    return Layout(tuple(dims))


def _pick(choices: list[Choice], layout: Layout, mode: str | None = None) -> list[int]:
    hits = [i for i, c in enumerate(choices) if c.strategy.output == layout
            and (mode is None or c.mode == mode)]
    return hits[:1]


def _expert_choice(options: list[Choice], shape: tuple[int, ...], mesh: tuple[int, int]
                   ) -> list[int]:
    """An expert parameter's choice: its expert dim split over every device when the expert
    count allows, else over the larger mesh axis that divides it, else the smaller (DeepSpeed's
    expert-parallel degree divides the expert count); the devices left over hold replicas,
    updated ZeRO-2 like the other parameters."""
    axes = active_axes(mesh)
    candidates = [axes] + [(a,) for a in sorted(axes, key=lambda a: -mesh[a])] if len(axes) > 1 \
        else [axes]
    for group in candidates:
        n = 1
        for a in group:
            n *= mesh[a]
        if not shape or shape[0] % n:
            continue
        dims: list[tuple[int, ...]] = [()] * len(shape)
        dims[0] = group
        want = Layout(tuple(dims))
        hit = _pick(options, want, "zero2") or _pick(options, want, "replicated")
        if hit:
            return hit
    return []


def _largest_dim_layout(shape: tuple[int, ...], mesh: tuple[int, int]) -> Layout:
    if not shape:
        return Layout(())
    dim = max(range(len(shape)), key=lambda d: (shape[d], -d))
    n = 1
    for a in active_axes(mesh):
        n *= mesh[a]
    return _all_axes_on(len(shape), dim, mesh) if shape[dim] >= n else Layout.replicated(len(shape))


def heuristic(nc: NodeChoices, ctx: CostContext) -> NodeChoices:
    """GSPMD-style propagation (see the module docstring)."""
    costs = OpCosts(nc, ctx)
    members: dict[str, list] = {}
    for node in nc.graph.nodes:
        members.setdefault(nc.root_of[node.name], []).append(node)
    chosen: dict[str, int] = {}
    for node in nc.graph.nodes:
        root = nc.root_of[node.name]
        if root != node.name or node.role == "param":
            continue  # parameters take the layout their first consumer wants
        options = nc.choices[root]
        if node.is_source:
            want = _largest_dim_layout(node.out.shape, nc.mesh_shape)
            chosen[root] = (_pick(options, want) or [0])[0]
            continue
        q = min(range(len(options)),
                key=lambda q: sum(_tree_cost(costs, nc, members[root], q, chosen)))
        chosen[root] = q
        for v in members[root]:
            for j, name in enumerate(v.inputs):
                producer = nc.root_of[name]
                if producer not in chosen:  # an unplaced parameter: place it for this use
                    chosen[producer] = _best_operand(costs, nc, v, j, q)
    for p in nc.graph.params():
        chosen.setdefault(p.name, 0)
    return restrict(nc, {r: [i] for r, i in chosen.items()})


def _best_operand(costs: OpCosts, nc: NodeChoices, node: object, j: int, q: int) -> int:
    """The layout to give an unplaced parameter for this use: one needing no resharding."""
    producer = nc.root_of[node.inputs[j]]
    return min(range(len(nc.choices[producer])),
               key=lambda p: (bool(costs.operand_recipe(node, j, p, q).steps),
                              operand_cost(costs, node, j, p, q), p))


def _tree_cost(costs: OpCosts, nc: NodeChoices, tree: list, q: int, chosen: dict[str, int]
               ) -> list[float]:
    """Cost of a root's whole tree at index ``q`` given the layouts already chosen upstream;
    an unplaced parameter costs what its best layout for this use costs."""
    out = []
    root = nc.root_of[tree[0].name]
    for v in tree:
        out.append(costs.compute_cost(v, nc.choices[v.name][q]))
        for j, name in enumerate(v.inputs):
            producer = nc.root_of[name]
            if producer == root:
                out.append(operand_cost(costs, v, j, q, q))
            elif producer in chosen:
                out.append(operand_cost(costs, v, j, chosen[producer], q))
            else:
                out.append(operand_cost(costs, v, j, _best_operand(costs, nc, v, j, q), q))
    return out


def expert(nc: NodeChoices) -> NodeChoices:
    """DeepSpeed-style expert parallelism + ZeRO-2 (see the module docstring). Raises
    ValueError when the model has no expert parameters."""
    keep: dict[str, list[int]] = {}
    experts = 0
    for node in nc.graph.nodes:
        options = nc.choices.get(node.name, [])
        if node.role == "param":
            if EXPERT_PARAM.search(node.state_name or ""):
                experts += 1
                keep[node.name] = _expert_choice(options, node.out.shape, nc.mesh_shape)
            else:
                want = Layout.replicated(len(node.out.shape))
                keep[node.name] = _pick(options, want, "zero2") or _pick(options, want)
        elif node.role in ("input", "target") and node.out.shape:
            keep[node.name] = _pick(options, _all_axes_on(len(node.out.shape), 0,
                                                          nc.mesh_shape))
    if not experts:
        raise ValueError("method 'expert' needs a mixture-of-experts model (parameters named "
                         "like '*.moe.w_in' or '*.experts.*'); this model has none")
    missing = [k for k, v in keep.items() if not v]
    if missing:
        raise ValueError(f"method 'expert' cannot lay out {missing[:3]} on this mesh")
    return restrict(nc, keep)
