"""A plan's decisions priced at another batch shape: what a new shape costs (issue 26.1).

The runtime serves a batch size or sequence length other than the example's by lowering the
plan's decisions on the program traced at that shape (`runtime/trainer.Trainer.serve`). This
prices exactly that program: the model traced at the new shape, the ILP of the plan's mesh
built on it, every decision the plan records (each op's strategy and operand layouts, each
parameter's layout and update mode, each batch tensor's split) fixed, and the rest (what the
plan does not record: buffers, constants) left to the solver, which finds them as the plan's
own search did. The result is a `Plan` of the same decisions with the new shape's
predictions, collectives and memory: `explain` and `simulate` read it like any other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import Any, Callable

from torch import nn

from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import cluster_from_dict
from meshplan.cost.mesh import logical_mesh
from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasibleIlpError
from meshplan.plan.plan import Plan
from meshplan.planner.intra.choices import Choice, IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import CostContext, Formulation, formulate
from meshplan.planner.intra.ilp import solve
from meshplan.planner.intra.to_plan import intra_plan
from meshplan.planner.recompute import Replay


def at_shape(plan: Plan, model: nn.Module, loss_fn: Callable | None, batch: Any) -> Plan:
    """``plan``'s decisions priced on ``model`` traced at ``batch``'s shape (module docstring).
    Raises ValueError when a decision is not open at that shape (a split the new sizes do not
    allow) or the micro-batches do not divide the batch; NotImplementedError for pipelines
    and HAP's model segments, not priced at other shapes yet."""
    if plan.num_stages > 1 or plan.segment_weights:
        raise NotImplementedError(
            "pricing a plan at another batch shape covers single-stage plans without model "
            "segments; for this one, make a plan with an example batch of the shape")
    micro = split_microbatches(batch, plan.microbatches)[0]
    _, traced = capture(model, loss_fn, micro)
    graph = with_compute_dtype(traced, plan.dtype)
    cl = cluster_from_dict(plan.cluster)
    mesh = logical_mesh(cl, tuple(plan.mesh_shape))
    if plan.axis_weights:
        mesh = replace(mesh, weights=plan.axis_weights,
                       gather_impl=plan.options.get("gather_impl", "auto"))
    opts = _options(plan)
    from meshplan.runtime.optim import OptimizerSpec
    ctx = CostContext(mesh, cl.device, OptimizerSpec.from_dict(plan.optimizer).state(),
                      param_reshard=plan.method == "heuristic", microbatches=plan.microbatches,
                      recompute=plan.recompute)
    segments, replay = None, None
    if plan.recompute:
        replay = Replay(plan.recompute_scope, plan.recompute_layers)
        layers = {}
        if replay.scope == "layers" and plan.num_layers > 1:
            from meshplan.lower.pipeline_program import recompute_layers
            layers = recompute_layers(traced, plan)
        segments = replay.segments(graph, layers)
        if not replay.whole:
            ctx = replace(ctx, recomputed=frozenset(segments))
    form = formulate(resolve_choices(graph, tuple(plan.mesh_shape), opts), ctx, None,
                     share_blocks=False, layers=segments)
    try:
        sol = solve(_fixed(form, plan))
    except InfeasibleIlpError:
        raise ValueError("the plan's decisions do not fit together at the shapes of this batch; "
                         "make a plan with an example batch of this shape") from None
    return intra_plan(form, sol, mesh, cl, name=plan.model, fingerprint=traced.fingerprint(),
                      method=plan.method, optimizer=plan.optimizer, options=opts, budget=None,
                      search_time_s=0.0, dtype=plan.dtype,
                      unsupported_ops=traced.unsupported_ops, axis_weights=plan.axis_weights,
                      layers=segments, replay=replay)


def _options(plan: Plan) -> IntraOptions:
    """The plan's own search options (`Plan.options` records them), without a budget."""
    names = {f.name for f in dataclasses.fields(IntraOptions)} - {"memory_budget",
                                                                  "replicated_updates"}
    given = {k: v for k, v in plan.options.items() if k in names}
    return IntraOptions(**given, replicated_updates=frozenset(
        plan.options.get("replicated_updates", ())))


def _fixed(form: Formulation, plan: Plan):
    """``form``'s problem with every root the plan decides fixed to that decision."""
    nc, g = form.choices, form.choices.graph
    ops = {o.node: (o.strategy, tuple(o.inputs), o.output) for o in plan.ops}
    params = {p.node: (p.spec, p.update) for p in plan.params}
    sources = {s.node: s.spec for s in plan.sources}
    costs = []
    for r, row in zip(form.roots, form.problem.node_costs):
        node = g.by_name[r]

        def key(c: Choice) -> Any:   # an op's strategy and layouts; a source's layout
            s = c.strategy
            if r in ops:
                return (s.describe(node.sig), tuple(lay.spec() for lay in s.inputs),
                        s.output.spec())
            return s.output.spec()

        want = ops.get(r) or (params[r][0] if r in params else sources.get(r))
        if want is None:
            costs.append(row)
            continue
        keep = [key(c) == want for c in nc.choices[r]]
        if r in params:   # of its layouts, the plan's update mode where it has a choice
            modes = [k and (c.mode or "replicated") == params[r][1]
                     for k, c in zip(keep, nc.choices[r])]
            keep = modes if any(modes) else keep
        if not any(keep):
            raise ValueError(f"the plan's decision for {r} ({want}) is not open at the shapes of "
                             "this batch (its sizes do not split so); make a plan with an "
                             "example batch of this shape")
        costs.append(tuple(x if k else math.inf for x, k in zip(row, keep)))
    return replace(form.problem, node_costs=tuple(costs))
