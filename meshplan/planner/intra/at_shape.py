"""A plan's decisions priced at another batch shape: what a new shape costs (issue 26.1).

The runtime serves a batch size or sequence length other than the example's by lowering the
plan's decisions on the program traced at that shape (`runtime/trainer.Trainer.serve`). This
prices exactly that program: the model traced at the new shape, the ILP of the plan's mesh
built on it, every decision the plan records (each op's strategy and operand layouts, each
parameter's layout and update mode, each batch tensor's split) fixed, and the rest (what the
plan does not record: buffers, constants) left to the solver, which finds them as the plan's
own search did. The result is a `Plan` of the same decisions with the new shape's
predictions, collectives and memory: `explain` and `simulate` read it like any other. A
pipeline is priced stage by stage the same way, each stage's program cut from the new trace
where its plan puts its ops (`runtime/pipeline.PipelineTrainer.serve` runs exactly those),
its latency and in-flight memory as the stage DP prices them; at the plan's own shape the
result is the plan.
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
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan
from meshplan.planner.intra.choices import Choice, IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import CostContext, Formulation, formulate
from meshplan.planner.intra.ilp import PLAN_REL_GAP, solve
from meshplan.planner.intra.to_plan import intra_plan
from meshplan.planner.recompute import Replay


def at_shape(plan: Plan, model: nn.Module, loss_fn: Callable | None, batch: Any) -> Plan:
    """``plan``'s decisions priced on ``model`` traced at ``batch``'s shape (module docstring).
    Raises ValueError when a decision is not open at that shape (a split the new sizes do not
    allow) or the micro-batches do not divide the batch; NotImplementedError for HAP's model
    segments, not priced at other shapes yet."""
    if plan.segment_weights:
        raise NotImplementedError(
            "pricing a plan at another batch shape does not cover plans cut into model "
            "segments yet; for this one, make a plan with an example batch of the shape")
    micro = split_microbatches(batch, plan.microbatches)[0]
    _, traced = capture(model, loss_fn, micro)
    if plan.num_stages > 1:
        return _pipeline_at_shape(plan, traced)
    layers = None
    if plan.recompute and plan.recompute_scope == "layers" and plan.num_layers > 1:
        from meshplan.lower.pipeline_program import recompute_layers
        layers = recompute_layers(traced, plan)
    form, sol, segments, replay, mesh, cl = _solved(plan, with_compute_dtype(traced, plan.dtype),
                                                    layers)
    return intra_plan(form, sol, mesh, cl, name=plan.model, fingerprint=traced.fingerprint(),
                      method=plan.method, optimizer=plan.optimizer, options=form_options(plan),
                      budget=None, search_time_s=0.0, dtype=plan.dtype,
                      unsupported_ops=traced.unsupported_ops, axis_weights=plan.axis_weights,
                      layers=segments, replay=replay)


def _solved(plan: Plan, graph: Graph, layers: dict[str, int] | None) -> tuple:
    """The single-stage ``plan``'s ILP on ``graph`` (at the plan's compute dtype) with its
    decisions fixed, solved: (formulation, solution, replayed segments, replay, mesh,
    cluster)."""
    cl = cluster_from_dict(plan.cluster)
    mesh = logical_mesh(cl, tuple(plan.mesh_shape))
    if plan.axis_weights:
        mesh = replace(mesh, weights=plan.axis_weights,
                       gather_impl=plan.options.get("gather_impl", "auto"))
    from meshplan.runtime.optim import OptimizerSpec
    ctx = CostContext(mesh, cl.device, OptimizerSpec.from_dict(plan.optimizer).state(),
                      param_reshard=plan.method == "heuristic", microbatches=plan.microbatches,
                      recompute=plan.recompute,
                      half_copies=plan.options.get("hold_half_copies", True))
    segments, replay = None, None
    if plan.recompute:
        replay = Replay(plan.recompute_scope, plan.recompute_layers)
        segments = replay.segments(graph, layers or {})
        if not replay.whole:
            ctx = replace(ctx, recomputed=frozenset(segments))
    form = formulate(resolve_choices(graph, tuple(plan.mesh_shape), form_options(plan)), ctx,
                     None, share_blocks=False, layers=segments)
    try:
        sol = solve(_fixed(form, plan), rel_gap=PLAN_REL_GAP)
    except InfeasibleIlpError:
        raise ValueError("the plan's decisions do not fit together at the shapes of this batch; "
                         "make a plan with an example batch of this shape") from None
    return form, sol, segments, replay, mesh, cl


def _pipeline_at_shape(plan: Plan, graph: Graph) -> Plan:
    """A pipeline's stages priced at the shape ``graph`` was traced at, as the runtime serves
    it (`PipelineTrainer.serve`): each stage's program cut where its plan puts its ops, its
    decisions fixed; each stage's latency per micro-batch and its memory with its in-flight
    micro-batches as the stage DP prices them, its inbound transfer on its link
    (`inbound_s`); the messages between stages anew, and the step from them as the
    search prices it (`to_plan.with_step_time`)."""
    from meshplan.lower.pipeline_program import (pipeline_exchanges, recompute_layers,
                                                 stage_graphs)
    from meshplan.lower.stage_transfers import step_transfers
    from meshplan.planner.intra.ilp_problem import peak_memory
    from meshplan.planner.inter.placement import share_a_host
    from meshplan.planner.inter.stage_costs import _in_flight_problem, inbound_s
    from meshplan.planner.inter.to_plan import with_step_time
    graphs = stage_graphs(graph, plan, check=False)
    layer_of = recompute_layers(graph, plan)
    cl = cluster_from_dict(plan.cluster)
    stages, compute, transfers = [], [], []
    for i, (s, g) in enumerate(zip(plan.stages, graphs)):
        sp = s.plan
        assert sp is not None
        form, sol, segments, replay, mesh, sub = _solved(sp, g, layer_of)
        priced = intra_plan(form, sol, mesh, sub, name=sp.model, fingerprint=g.fingerprint(),
                            method=sp.method, optimizer=sp.optimizer,
                            options=form_options(sp), budget=None, search_time_s=0.0,
                            dtype=sp.dtype, unsupported_ops=sp.options.get("unsupported_ops",
                                                                             ()),
                            layers=segments, replay=replay)
        # What the stage's first layer receives from the stages before, there and back.
        first = {n for n, k in layer_of.items() if k == s.layers[0]}
        users = g.users
        inbound = sum(n.out.nbytes * (2 if n.requires_grad else 1) for n in g.nodes
                      if n.role == "input" and n.op == "input" and not n.state_name
                      and any(u in first for u in users[n.name]))
        within = i and share_a_host(plan.stages[i - 1].devices, s.devices,
                                    cl.devices_per_host)
        compute.append(priced.objective / plan.microbatches)
        transfers.append(inbound_s(cl, inbound, len(s.devices) if within else None))
        latency = compute[-1] + transfers[-1]
        memory = peak_memory(_in_flight_problem(form, g, segments, s.in_flight), sol.choices)
        stages.append(dataclasses.replace(s, latency_s=latency, memory_bytes=memory,
                                          plan=priced))
    meshes = len(stages) // plan.chunks
    peak = max(math.fsum(s.memory_bytes for s in stages[i::meshes]) for i in range(meshes))
    out = replace(plan, graph_fingerprint=graph.fingerprint(), stages=tuple(stages),
                  search_time_s=0.0, predicted={**plan.predicted, "peak_memory_bytes": peak})
    out = replace(out, transfers=step_transfers(out, pipeline_exchanges(out), graph))
    return with_step_time(out, compute, transfers)


def form_options(plan: Plan) -> IntraOptions:
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
