"""What the runtime's overlap of communication with compute saves, as a term of the intra-op ILP.

Eq. 1 charges every collective in full. The runtime all-reduces replicated gradients in buckets
while the last micro-batch's backward still runs (`lower/overlap.py`). Charged in full, data
parallelism looks dearer than it runs: Wide-ResNet (26 layers, 448 channels, batch 32) on 8
V100 priced pure data parallelism at 0.518 s a step where it runs in 0.457 s, and the ILP took
a ZeRO plan of 0.469 s instead (with this term: data parallel, priced 0.456 s).

The term (`OverlapTerm`) takes back ``min(hidden, window)``: ``hidden`` the gradient
synchronization eq. 1 charges, ``window`` the backward's compute (its forward's replay
included where recomputed). That is what `lower/overlap.step_passes` gives when every bucket
could start at once; the runtime starts each when its gradients are complete, so the last is
exposed: an optimistic estimate, which the plan's own prediction (`extract`) prices exactly.

A parameter's synchronization depends on both ends of its use: the axes its gradient is
partial over are the consumer's strategy's, the update mode the parameter's. ``hidden`` is
attached to the consumer (its first use), priced as a replicated all-reduce over those axes:
never more than eq. 1 charges whatever the mode (ZeRO's reduce-scatter and gather sum to an
all-reduce, once per micro-batch), so the ILP can never gain by a saving it was not charged
for. Hidden by the parameter's strategy alone, it counted an all-reduce for a consumer that
repeats the work on every device and has no partial gradient: planning tiny models, the ILP
chose such plans for savings that do not exist (a 2-layer MoE on 4 V100: objective 70 us,
step 132 us). ZeRO's collectives in the earlier micro-batches' backwards, and ZeRO-3's
gathers, stay charged in full. Parameters updated by SFB (their own charge) get no term.
Abstract (alpha-beta) problems have no compute to hide behind and get none.
"""

from __future__ import annotations

from meshplan.planner.intra.choices import NodeChoices
from meshplan.planner.intra.ilp_problem import OverlapTerm
from meshplan.planner.intra.op_costs import OpCosts, local_bytes, sync_cost


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
    g = nc.graph
    for node in g.nodes:
        i = index.get(nc.root_of[node.name])
        if i is None:
            continue
        for p, choice in enumerate(nc.choices[node.name]):
            f, b = costs.pass_times(node, choice)
            window[i][p] += b + (f if ctx.replays(node.name) else 0.0)
        for j, name in enumerate(node.inputs):
            param = costs.param_root.get(name)
            if param is None or param in seen:
                continue
            seen.add(param)
            u = g.by_name[name]
            if not u.requires_grad or any(c.mode == "sfb" for c in nc.choices[param]):
                continue
            for p, choice in enumerate(nc.choices[node.name]):
                hidden[i][p] += _all_reduce_s(costs, choice.strategy.grad_partial[j],
                                              local_bytes(u, choice.strategy.inputs[j],
                                                          costs.shape))
    if not any(any(row) for row in hidden):
        return ()
    return (OverlapTerm(_frozen(hidden), _frozen(window), 1.0),)


def _all_reduce_s(costs: OpCosts, axes: tuple[int, ...], nbytes: int) -> float:
    """A replicated update's all-reduce as eq. 1 charges it (`sync_cost`, bucketed)."""
    return sync_cost("replicated", tuple(sorted(axes)), nbytes, costs.ctx.mesh, bucketed=True)


def _frozen(rows: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(row) for row in rows)
