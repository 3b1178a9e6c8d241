"""Different shard ratios across the model (HAP §5.2): the program cut into segments, each
split by ratios of its own, values re-cut where a segment reads what another one cut.

Layers differ in what bounds them — a matmul-heavy block runs at the devices' FLOP/s ratio, a
memory-bound one at their bandwidth ratio, one whose padded gathers cost the largest share
wants its shares even — so one ratio set for the whole program is a compromise. Here:

- `cut_segments` cuts the ops, in program order, into ``count`` contiguous segments of about
  equal FLOPs, each cut placed where the fewest activation bytes cross it (HAP partitions with
  METIS for the same two aims; a program's order makes it a 1-D search). A source (parameter,
  input) belongs to the segment of its first reader.
- `resplits` lists the re-cuts the runtime makes (`lower/program.py`, `Comm.resplit`): a value
  split on the mesh, read by an op of another segment than the one whose ratios cut it, is
  re-cut by one all-to-all (forward, and back in backward), once per value, move and segment.
- `segmented_plan` prices a plan with its segments (each op at its segment's slowest share,
  each collective at its segment's shares) and lists its collectives per segment, the re-cuts
  as collectives of kind "resplit". The LP (`load_balance.balance`) takes one ratio set per
  segment from `alternate.program_phases(form, choices, segment_of, resplit_entries(...))`.

Segments need a one-row mesh, as the hetero programs are: the runtime re-cuts a dim over one
axis group whose pieces one segment cut whole.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from meshplan.lower.overlap import step_passes
from meshplan.cost.mesh import LogicalMesh, with_shares
from meshplan.ir.graph import Graph
from meshplan.lower.grain import cut_units
from meshplan.lower.shards import cut
from meshplan.plan.plan import CollectiveEntry, Plan
from meshplan.planner.intra.extract import extract, node_indices
from meshplan.planner.intra.formulate import CostContext, Formulation
from meshplan.planner.intra.layout import Layout
from meshplan.planner.intra.op_costs import OpCosts, param_roots
from meshplan.planner.intra.reshard import reshard

Weights = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Resplit:
    """``value`` re-cut on ``dim`` over ``axes`` for ``consumer`` (of segment ``segment``)."""

    value: str
    consumer: str
    segment: int
    dim: int
    axes: tuple[int, ...]
    nbytes: int
    needs_grad: bool


def cut_segments(graph: Graph, count: int) -> dict[str, int]:
    """Every node's segment (module docstring). Raises ValueError unless ``1 <= count <=``
    the number of ops with FLOPs."""
    ops = [n for n in graph.nodes if not n.is_source]
    heavy = sum(1 for n in ops if n.flops > 0)
    if not 1 <= count <= max(heavy, 1):
        raise ValueError(f"segments must be between 1 and the program's {heavy} ops with "
                         f"FLOPs, got {count}")
    pos = {n.name: i for i, n in enumerate(ops)}
    # crossing[i]: bytes of op outputs made before op i and read at or after it.
    delta = [0.0] * (len(ops) + 1)
    last = {n.name: pos[n.name] for n in ops}
    for n in ops:
        for name in n.inputs:
            if name in last:
                last[name] = max(last[name], pos[n.name])
    for n in ops:
        if last[n.name] > pos[n.name]:
            delta[pos[n.name] + 1] += n.out.nbytes
            delta[last[n.name] + 1] -= n.out.nbytes
    crossing, run = [], 0.0
    for d in delta[:-1]:
        run += d
        crossing.append(run)
    prefix = [0.0]
    for n in ops:
        prefix.append(prefix[-1] + n.flops)
    total = prefix[-1] or 1.0
    cuts = [0]
    for k in range(1, count):
        target = total * k / count
        window = [i for i in range(cuts[-1] + 1, len(ops) - (count - k) + 1)
                  if abs(prefix[i] - target) <= total / (2 * count)]
        if not window:   # one op holds more than a segment's share: the nearest cut
            window = [min(range(cuts[-1] + 1, len(ops) - (count - k) + 1),
                          key=lambda i: abs(prefix[i] - target))]
        cuts.append(min(window, key=lambda i: (crossing[i], abs(prefix[i] - target))))
    out = {n.name: sum(1 for c in cuts[1:] if pos[n.name] >= c) for n in ops}
    users = graph.users
    for n in graph.nodes:
        if n.is_source:   # in its first reader's segment (readers come in program order)
            readers = [out[u] for u in users.get(n.name, ()) if u in out]
            out[n.name] = readers[0] if readers else 0
    return out


def resplits(graph: Graph, plan: Plan, segment_of: Mapping[str, int],
             weights: Sequence[Weights] | None) -> list[Resplit]:
    """The re-cuts of ``plan`` with ``segment_of`` under per-segment ``weights`` (module
    docstring), found as the runtime finds them; ``weights`` None: as if every two segments
    cut every dim differently (the candidates, before the ratios are known)."""
    units = cut_units(graph)
    roots = param_roots(graph)
    ops = {o.node: o for o in plan.ops}
    params = {p.node: p.spec for p in plan.params}
    sources = {s.node: s.spec for s in plan.sources}
    layout: dict[str, Layout] = {}
    cutter: dict[str, list[int]] = {}   # per dim: the segment whose ratios cut it
    moved: dict[tuple, list[int]] = {}
    done: set[tuple] = set()
    out: list[Resplit] = []
    for node in graph.nodes:
        k = segment_of.get(node.name, 0)
        ndim = len(node.out.shape)
        if node.is_source:
            spec = params.get(node.name) or sources.get(node.name)
            layout[node.name] = Layout.parse(spec, ndim) if spec else Layout.replicated(ndim)
            cutter[node.name] = [k] * ndim
            continue
        dec = ops[node.name]
        for j, name in enumerate(node.inputs):
            producer = graph.by_name[name]
            want = Layout.parse(dec.inputs[j], len(producer.out.shape))
            recipe = reshard(layout[name], want, producer.out.nbytes, tuple(plan.mesh_shape),
                             tuple(dec.grad_partial[j]), producer.requires_grad,
                             name in roots)
            key = (name, recipe, node.name in roots)
            if key not in moved:   # the move runs once, cutting anew by its first reader
                by = list(cutter[name])
                for s in recipe.steps:
                    if s.op in ("split", "reduce_scatter"):
                        by[s.dim] = k
                    elif s.op == "all_to_all":
                        by[s.dim2] = k
                moved[key] = by
            if (*key, k) in done:
                continue
            done.add((*key, k))
            for d, axes in enumerate(want.dims):
                s = moved[key][d]
                if not axes or s == k:
                    continue
                n, u = producer.out.shape[d], units.get((name, d), 1)
                if weights is None or cut(n, axes, weights[s], u) != cut(n, axes, weights[k], u):
                    out.append(Resplit(name, node.name, k, d, tuple(axes), producer.out.nbytes,
                                       producer.requires_grad))
        layout[node.name] = Layout.parse(dec.output, ndim)
        cutter[node.name] = [k] * ndim
    return out


def resplit_entries(found: Sequence[Resplit], microbatches: int, recompute: bool
                    ) -> list[tuple[int, CollectiveEntry]]:
    """The all-to-alls of ``found`` per step, with their segments."""
    ctx = CostContext(LogicalMesh((1, 1), (0.0, 0.0), (0.0, 0.0)), None,
                      microbatches=microbatches, recompute=recompute)
    counts: Counter[tuple] = Counter()
    for r in found:
        for phase in ("forward", "backward") if r.needs_grad else ("forward",):
            for label, n in ctx.phase_counts(phase):
                counts[(r.segment, r.nbytes, r.axes, label)] += n
    return [(k, CollectiveEntry("resplit", b, a, p, c))
            for (k, b, a, p), c in sorted(counts.items())]


def segmented_plan(plan: Plan, form: Formulation, choices: tuple[int, ...], real: CostContext,
                   segment_of: Mapping[str, int], weights: Sequence[Weights]) -> Plan:
    """``plan`` (one segment, made from ``form`` and ``choices``) cut into segments with
    per-segment ``weights``: its collectives listed per segment with the re-cuts, and its
    predictions priced with each op and collective at its own segment's shares. Raises
    ValueError for a plan the runtime cannot cut so (module docstring)."""
    graph = form.choices.graph
    _check(plan, segment_of, weights, graph)
    meshes = [with_shares(real.mesh, w, plan.options.get("gather_impl", "auto"))
              for w in weights]
    result = extract(form, choices, real)
    entries: Counter[tuple] = Counter()
    for owner, c in result.owned:
        entries[(c.kind, c.bytes, c.mesh_axes, c.phase, segment_of.get(owner, 0))] += c.count
    found = resplits(graph, plan, segment_of, weights)
    for k, c in resplit_entries(found, plan.microbatches, plan.recompute):
        entries[(c.kind, c.bytes, c.mesh_axes, c.phase, k)] += c.count
    colls = tuple(CollectiveEntry(kind, b, a, p, n, k)
                  for (kind, b, a, p, k), n in sorted(entries.items()))
    forward, backward = _compute(form, choices, real, segment_of, meshes, result.figures)
    m = real.microbatches
    f_s, b_s, u_s = step_passes(forward, backward, colls, plan.overlap, meshes, m,
                                forward if real.recompute else 0.0,
                                result.figures.get("update_s", 0.0))
    predicted = {**plan.predicted, "forward_s": forward, "backward_s": backward,
                 "step_time_s": m * (f_s + b_s) + u_s}
    return replace(plan, collectives=colls, predicted=predicted,
                   options={**plan.options, "segment_recuts": len(found)},
                   axis_weights=tuple(weights[0]),
                   segment_weights=tuple(tuple(tuple(a) for a in w) for w in weights),
                   segment_of=dict(segment_of))


def _compute(form: Formulation, choices: tuple[int, ...], real: CostContext,
             segment_of: Mapping[str, int], meshes: Sequence[LogicalMesh],
             whole: Mapping[str, float]) -> tuple[float, float]:
    """One micro-batch's forward and backward seconds, each op at its segment's slowest
    share (`OpCosts.pass_times`): ``whole`` (`extract`'s figures at one share set, an SFB
    weight's whole-batch gradient included) with every op's time moved to its segment's."""
    nc, idx = form.choices, node_indices(form, choices)
    costs = [OpCosts(nc, replace(real, mesh=m)) for m in meshes]
    plain = OpCosts(nc, real)
    forward = backward = 0.0
    for node in nc.graph.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        f, b = costs[segment_of.get(node.name, 0)].pass_times(node, choice)
        f0, b0 = plain.pass_times(node, choice)
        forward, backward = forward + f - f0, backward + b - b0
    return whole["forward_s"] + forward, whole["backward_s"] + backward


def _check(plan: Plan, segment_of: Mapping[str, int], weights: Sequence[Weights],
           graph: Graph) -> None:
    if plan.num_stages > 1:
        raise ValueError("segments cut a single-stage plan; this plan has "
                         f"{plan.num_stages} pipeline stages")
    if plan.mesh_shape[0] != 1:
        raise ValueError(f"segments need a one-row mesh (1, n), as hetero programs are; this "
                         f"plan's mesh is {tuple(plan.mesh_shape)}")
    missing = [n.name for n in graph.nodes if n.name not in segment_of]
    if missing:
        raise ValueError(f"segment_of names no segment for {len(missing)} nodes, e.g. "
                         f"{missing[0]!r}")
    count = max(segment_of.values(), default=0) + 1
    if len(weights) != count or min(segment_of.values(), default=0) < 0:
        raise ValueError(f"segment_of numbers {count} segments (0..{count - 1}); "
                         f"{len(weights)} weight sets given")
    for w in weights:
        if len(w) != 2 or tuple(len(a) for a in w) != tuple(plan.mesh_shape) \
                or min(min(a) for a in w) < 0 or any(sum(a) <= 0 for a in w):
            raise ValueError(f"each segment's weights are one non-negative list per mesh axis "
                             f"({tuple(plan.mesh_shape)}), each with a positive sum; got {w!r}")


def ratio_weights(ratios: Sequence[float]) -> Weights:
    """One-row mesh weights of per-device ``ratios`` (normalized)."""
    total = math.fsum(ratios)
    return ((1.0,), tuple(float(r) / total for r in ratios))
