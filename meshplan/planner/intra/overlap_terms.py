"""What the runtime's overlap of communication with compute saves, as a term of the intra-op ILP.

Eq. 1 charges every collective in full. The runtime all-reduces replicated gradients in buckets
while the last micro-batch's backward still runs (`lower/overlap.py`). Charged in full, data
parallelism looks dearer than it runs: Wide-ResNet (26 layers, 448 channels, batch 32) on 8
V100 priced pure data parallelism at 0.518 s a step where it runs in 0.457 s, and the ILP took
a ZeRO plan of 0.469 s instead (with this term: data parallel, priced 0.456 s).

The term (`OverlapTerm`) takes back ``min(hidden, window)``: ``hidden`` the gradient
synchronization eq. 1 charges, ``window`` the backward's compute (its forward's replay
included where recomputed). That is what `lower/overlap.step_passes` gives when every bucket
could start at once. The runtime starts each when its gradients are complete, in the reverse
of their first use: the term is in order (`OverlapTerm.in_order`), so a parameter's
synchronization hides only behind the backward of the ops before its use, and the first
layer's (an embedding's) stays exposed; and in the runtime's gradient buckets, each waiting
for its earliest-used parameter (`lower/overlap.grad_buckets`, the parameters whole). Still a
little optimistic (a bucket's collective is priced per parameter, and sharded parameters
fill buckets more slowly), which the plan's own prediction (`extract`) prices exactly.
Without the order, a tiny model's one bucket counted as hidden behind a backward that was
over before it could start (GPT of 2 layers, hidden 256, on 4 V100: objective 187 us, step
258 us).

A parameter's synchronization depends on both ends of its use: the axes its gradient is partial
over are the consumer's strategy's, the update mode the parameter's. ``hidden`` is attached to
the consumer (its first use; a view of the parameter, a transpose or reshape, is the parameter,
not a use: taken for one, an MoE's expert weights, read through permutes, had their 2 x 302 MB
of gradients charged and none hidden, and the ILP priced data parallelism 6 % over its step and
took a slower plan), priced as a replicated all-reduce over those axes: never more than eq. 1
charges whatever the mode (ZeRO's reduce-scatter and gather sum to an all-reduce, once per
micro-batch), so the ILP can never gain by a saving it was not charged for. Of that all-reduce
only the reduce-scatter's share hides under ZeRO, whose gather of the new values follows the
update: the rest is gated on the parameter not being ZeRO's (once the update was priced,
ZeRO-2's sharded update made it worth choosing without a memory budget, and a Wide-ResNet's
ZeRO-2 plan priced 6 % under its own prediction). Hidden by the parameter's strategy alone, it
counted an all-reduce for a consumer that repeats the work on every device and has no partial
gradient: planning tiny models, the ILP chose such plans for savings that do not exist (a
2-layer MoE on 4 V100: objective 70 us, step 132 us). ZeRO's collectives in the earlier
micro-batches' backwards, and ZeRO-3's gathers, stay charged in full. A parameter SFB may update
(`sfb.py`) has its seconds on its one consumer gated by its own choice (`OverlapTerm.gated`):
they count unless it picks SFB, which has no all-reduce. Left out, such weights made a method
that offers SFB ("hetero") price data parallelism dearer than one that does not.
Abstract (alpha-beta) problems have no compute to hide behind and get none.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple

from meshplan.cost.collectives import collective_cost
from meshplan.lower.overlap import GroupParam, ParamUse, grad_buckets
from meshplan.planner.intra.choices import UPDATE_MODES, NodeChoices
from meshplan.planner.intra.ilp_problem import OverlapTerm
from meshplan.planner.intra.op_costs import OpCosts, local_bytes, sync_cost


ZERO_MODES = tuple(m for m in UPDATE_MODES if m.startswith("zero"))


def overlap_terms(costs: OpCosts, nc: NodeChoices, roots: list[str]) -> tuple[OverlapTerm, ...]:
    """The term of the module docstring over ``roots`` (the ILP's nodes, in order); empty
    without compute or anything to hide."""
    ctx = costs.ctx
    if ctx.device is None:
        return ()
    index = {r: i for i, r in enumerate(roots)}
    window = [[0.0] * len(nc.choices[r]) for r in roots]
    hidden = [[0.0] * len(nc.choices[r]) for r in roots]
    seen: set[str] = set()
    consumer: dict[str, int] = {}   # a synchronized parameter's consumer: its program position
    gated: list[tuple[int, int, tuple[int, ...], tuple[float, ...]]] = []
    scattered: list[tuple[int, int, tuple[int, ...], tuple[float, ...]]] = []   # ZeRO's
    zero_params: list[str] = []
    g = nc.graph
    for step, node in enumerate(g.nodes):
        i = index.get(nc.root_of[node.name])
        if i is None:
            continue
        for p, choice in enumerate(nc.choices[node.name]):
            f, b = costs.pass_times(node, choice)
            window[i][p] += b + (f if ctx.replays(node.name) else 0.0)
        if node.name in costs.param_root:   # a view of a parameter is it, not a use of it
            continue
        for j, name in enumerate(node.inputs):
            param = costs.param_root.get(name)
            if param is None or param in seen:
                continue
            seen.add(param)
            u = g.by_name[name]
            sfb = tuple(p for p, c in enumerate(nc.choices[param]) if c.mode == "sfb")
            if not u.requires_grad or (sfb and costs.sfb[param].consumer != node.name):
                continue
            consumer[param] = step
            # The parameter's bytes, as eq. 1 charges them: a view of it (read in its
            # layout, the parameter's plus unsplit dims) may be broadcast, its bytes many.
            whole = g.by_name[param]
            row = [_all_reduce_s(costs, choice.strategy.grad_partial[j],
                                 local_bytes(whole, choice.strategy.inputs[j], costs.shape))
                   for choice in nc.choices[node.name]]
            # Under ZeRO only the last backward's reduce-scatter can hide: ZeRO-2 gathers the
            # new values after the update. So the rest of the all-reduce counts while the
            # parameter is not ZeRO's.
            scatter = [min(_reduce_scatter_s(costs, choice.strategy.grad_partial[j],
                                             local_bytes(whole, choice.strategy.inputs[j],
                                                         costs.shape)), r)
                       for choice, r in zip(nc.choices[node.name], row)]
            zeroed = tuple(p for p, c in enumerate(nc.choices[param]) if c.mode in ZERO_MODES)
            if sfb:   # no all-reduce under SFB
                gated.append((i, index[param], sfb, tuple(scatter)))
            else:
                hidden[i] = [h + x for h, x in zip(hidden[i], scatter)]
            if any(r > x for r, x in zip(row, scatter)):
                gated.append((i, index[param], tuple(sorted({*sfb, *zeroed})),
                              tuple(r - x for r, x in zip(row, scatter))))
            unzeroed = tuple(p for p, c in enumerate(nc.choices[param])
                             if c.mode not in ZERO_MODES)
            if ctx.microbatches > 1 and len(unzeroed) < len(nc.choices[param]):
                zero_params.append(param)
                scattered.append((i, index[param], unzeroed, tuple(
                    _reduce_scatter_s(costs, choice.strategy.grad_partial[j],
                                      local_bytes(whole, choice.strategy.inputs[j], costs.shape))
                    for choice in nc.choices[node.name])))
    terms = []
    if gated or any(any(row) for row in hidden):
        terms.append(OverlapTerm(_frozen(hidden), _frozen(window), 1.0, in_order=True,
                                 ready=_ready(nc, index, consumer, len(roots),
                                              grad_buckets(_whole(nc, consumer))),
                                 gated=tuple(gated)))
    if any(any(row) for *_, row in scattered):
        # ZeRO reduce-scatters every micro-batch's gradients from their hooks, each parameter's
        # as soon as it is complete: in the backwards before the last, behind that backward.
        # Its lower bound linear in the choices (`OverlapTerm.linear`): what runs before the
        # stage's first window or exceeds the windows up to it counts as exposed.
        zeros = [[0.0] * len(row) for row in window]
        terms.append(OverlapTerm(_frozen(zeros), _frozen(window), ctx.microbatches - 1.0,
                                 in_order=True, gated=tuple(scattered), linear=True,
                                 ready=_ready(nc, index, consumer, len(roots),
                                              [_Bucket((p,)) for p in zero_params])))
    return tuple(terms)


class _Bucket(NamedTuple):
    params: tuple[str, ...]


def _whole(nc: NodeChoices, consumer: dict[str, int]) -> list[GroupParam]:
    """The parameters of ``consumer`` whole, as data parallelism holds them, each used at its
    consumer's position."""
    g = nc.graph
    return [GroupParam(p, p, (), g.by_name[p].out.dtype, g.by_name[p].out.nbytes,
                       ParamUse(at, at)) for p, at in consumer.items()]


def _ready(nc: NodeChoices, index: dict[str, int], consumer: dict[str, int], num_nodes: int,
           buckets: Sequence[Any]) -> tuple[int, ...]:
    """Per ILP node, the node after whose backward its hidden seconds can start: its
    gradients' bucket's (one of ``buckets``: `lower/overlap.grad_buckets`, the runtime's, or
    one parameter each) earliest-used parameter's consumer (``consumer``: its position in
    the program), as the last ILP node at or before it. By the consumer's own position, not
    its root's: a follower (a layer norm's scale, a bias added) may come long after its root
    (the residual stream's), and bucketed from there its gradient, complete late in the
    backward, held back the bucket of everything used after it."""
    g = nc.graph
    root_at = [k for k, n in enumerate(g.nodes) if n.name in index]   # positions, in order
    ready: dict[int, int] = {}   # a node whose seconds are several buckets': the latest
    for bucket in buckets:
        at = bisect_right(root_at, min(consumer[p] for p in bucket.params)) - 1
        for p in bucket.params:
            v = index[nc.root_of[g.nodes[consumer[p]].name]]
            ready[v] = min(ready.get(v, at), at)
    return tuple(ready.get(v, v) for v in range(num_nodes))


def _all_reduce_s(costs: OpCosts, axes: tuple[int, ...], nbytes: int) -> float:
    """A replicated update's all-reduce as eq. 1 charges it (`sync_cost`, bucketed)."""
    return sync_cost("replicated", tuple(sorted(axes)), nbytes, costs.ctx.mesh, bucketed=True)


def _reduce_scatter_s(costs: OpCosts, axes: tuple[int, ...], nbytes: int) -> float:
    """One micro-batch's ZeRO reduce-scatter as eq. 1 charges it (`zero_counts`)."""
    return collective_cost("reduce_scatter", costs.ctx.mesh, tuple(sorted(axes)), nbytes) \
        if axes else 0.0


def _frozen(rows: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(row) for row in rows)
