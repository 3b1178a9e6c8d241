"""What crosses between the ranks of a pipeline in one step, as resharding plans and as a list.

Three kinds of point-to-point traffic follow from a multi-stage plan and the traced program's
shapes: every value an `Exchange` moves (its activation forward, its gradient back when it
requires one), once per micro-batch, each a cross-mesh resharding plan (`cross_mesh.py`) with
Alpa's local all-gathers among the destination replicas of each host; and, once per step, the
gradient of every parameter several stages hold, sent from each holder to each other holder in
its layout (no local all-gather: every rank of the receiving layout needs its own tile). The
runtime moves exactly these plans (`runtime/pipeline.py`); `step_transfers` lists them for the
plan, so the bytes a run records can be compared with the plan's, and the simulator can price
them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

from meshplan.cost.cluster import cluster_from_dict
from meshplan.ir.graph import Graph
from meshplan.lower.cross_mesh import MeshRanks, ReshardPlan, plan_reshard
from meshplan.lower.pipeline_program import Exchange
from meshplan.plan.plan import ParamDecision, Plan, TransferEntry
from meshplan.planner.intra.layout import Layout


@dataclass(frozen=True)
class StageMoves:
    """Every resharding plan of a pipeline step: ``exchanges[(k, kind)]`` moves exchange k's
    activation or gradient; ``tied[(name, a, b)]`` the gradient of shared parameter ``name``
    from holder stage a to holder stage b; ``shared[name]`` its holder stages in order."""

    exchanges: dict[tuple[int, str], ReshardPlan]
    tied: dict[tuple[str, int, int], ReshardPlan]
    shared: dict[str, list[int]]
    requires_grad: dict[str, bool]


def stage_moves(plan: Plan, exchanges: Sequence[Exchange], graph: Graph,
                local_gather: bool = True) -> StageMoves:
    """The resharding plans of ``plan``'s step (module docstring), its stages moving
    ``exchanges`` (`pipeline_exchanges`); ``graph`` is the whole program traced at one
    micro-batch (shapes and dtypes of the values that cross); ``local_gather`` False sends
    every destination replica its whole tile instead. Raises
    NotImplementedError for a shared parameter a holder keeps ZeRO-sharded (its gradient is
    then a shard of the data-parallel group, not the whole in the stage's layout)."""
    meshes = [MeshRanks(tuple(s.mesh_shape), tuple(s.devices)) for s in plan.stages]
    per_host = cluster_from_dict(plan.cluster).devices_per_host
    moves = {}
    for k, e in enumerate(exchanges):
        shape, size = _shape_and_itemsize(graph, e.value)
        src, dst = Layout.parse(e.src_spec, len(shape)), Layout.parse(e.dst_spec, len(shape))
        moves[(k, "activation")] = plan_reshard(
            shape, size, meshes[e.src], src, meshes[e.dst], dst, local_gather=local_gather,
            devices_per_host=per_host)
        moves[(k, "gradient")] = plan_reshard(
            shape, size, meshes[e.dst], dst, meshes[e.src], src, local_gather=local_gather,
            devices_per_host=per_host)
    holders: dict[str, list[tuple[int, ParamDecision]]] = {}
    for s in plan.stages:
        for p in s.plan.params if s.plan else ():
            holders.setdefault(p.name, []).append((s.index, p))
    shared = {name: [i for i, _ in h] for name, h in sorted(holders.items()) if len(h) > 1}
    tied = {}
    for name in shared:
        for i, p in holders[name]:
            if p.update != "replicated":
                raise NotImplementedError(
                    f"parameter {name!r} is shared by stages {shared[name]} and stage {i} "
                    f"keeps it {p.update}; summing a ZeRO-sharded gradient across stages is "
                    "not implemented: plan without ZeRO for it")
        for a, pa in holders[name]:
            shape, size = _shape_and_itemsize(graph, pa.node)
            for b, pb in holders[name]:
                if a != b:
                    tied[(name, a, b)] = plan_reshard(
                        shape, size, meshes[a], Layout.parse(pa.spec, len(shape)),
                        meshes[b], Layout.parse(pb.spec, len(shape)), local_gather=False)
    requires_grad = {e.value: graph.by_name[e.value].requires_grad for e in exchanges}
    return StageMoves(moves, tied, shared, requires_grad)


def step_transfers(plan: Plan, exchanges: Sequence[Exchange], graph: Graph
                   ) -> tuple[TransferEntry, ...]:
    """Every point-to-point message between two different ranks in one step of ``plan``,
    counted by (stages, kind, source, destination, bytes): "activation" and "gradient"
    transfers and the "gather" slices of local all-gathers once per micro-batch, "tied"
    gradient parts once per step (module docstring)."""
    moves = stage_moves(plan, exchanges, graph)
    count: Counter[tuple[tuple[int, ...], str, int, int, int]] = Counter()
    for (k, kind), move in moves.exchanges.items():
        e = exchanges[k]
        if kind == "gradient" and not moves.requires_grad[e.value]:
            continue
        stages = (e.src, e.dst) if kind == "activation" else (e.dst, e.src)
        for key, n in _messages(move, kind).items():
            count[(stages, *key)] += n * plan.microbatches
    for move in moves.tied.values():
        count.update({((), *key): n for key, n in _messages(move, "tied").items()})
    return tuple(TransferEntry(kind, src, dst, nbytes, n, stages)
                 for (stages, kind, src, dst, nbytes), n in sorted(count.items()))


def _messages(move: ReshardPlan, kind: str) -> Counter[tuple[str, int, int, int]]:
    """The messages between different ranks of one resharding: its transfers, then each
    local all-gather's slices (every replica sends its slice to each other replica)."""
    out: Counter[tuple[str, int, int, int]] = Counter(
        (kind, t.src, t.dst, t.nbytes) for t in move.transfers if t.src != t.dst)
    itemsize = _itemsize_of(move)
    for g in move.gathers:
        extent = [b - a for a, b in g.box]
        for q, src in enumerate(g.ranks):
            extent[g.dim] = g.cuts[q + 1] - g.cuts[q]
            for dst in g.ranks:
                if dst != src:
                    out[("gather", src, dst, prod(extent) * itemsize)] += 1
    return out


def _itemsize_of(move: ReshardPlan) -> int:
    t = move.transfers[0]
    return t.nbytes // max(prod(b - a for a, b in t.box), 1)


def _shape_and_itemsize(graph: Graph, name: str) -> tuple[tuple[int, ...], int]:
    node = graph.by_name[name]
    dtype = getattr(torch, node.out.dtype)
    return tuple(node.out.shape), torch.empty((), dtype=dtype).element_size()
