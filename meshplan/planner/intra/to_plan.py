"""An ILP solution as a `Plan`: the decisions, collectives and predictions of one intra-operator
plan on one logical mesh (a whole single-stage plan, or one pipeline stage's)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Mapping

from meshplan.cost.cluster import Cluster, cluster_to_dict
from meshplan.cost.mesh import LogicalMesh
from meshplan.plan.plan import Plan
from meshplan.planner.intra.choices import IntraOptions
from meshplan.planner.intra.extract import extract
from meshplan.planner.intra.formulate import Formulation
from meshplan.planner.intra.ilp_problem import IlpSolution
from meshplan.planner.recompute import FULL, Replay


def ilp_memory(form: Formulation, choices: tuple[int, ...]) -> float:
    mem = form.problem.node_memory
    return float(sum(mem[i][c] for i, c in enumerate(choices))) if mem else 0.0


def intra_plan(form: Formulation, sol: IlpSolution, real_mesh: LogicalMesh, cluster: Cluster,
               *, name: str, fingerprint: str, method: str, optimizer: dict[str, Any],
               options: IntraOptions, budget: float | None, search_time_s: float,
               dtype: str, unsupported_ops: tuple[str, ...],
               axis_weights: tuple[tuple[float, ...], ...] = (),
               layers: Mapping[str, int] | None = None, replay: Replay | None = None) -> Plan:
    """The plan of ``sol``: predictions priced on ``real_mesh`` (the cluster's own α/β, with
    compute) whatever units ``form`` was solved in; ``layers`` (each replayed node's segment)
    and ``replay`` (what they are) when a recomputed stage replays segment by segment."""
    ctx = form.ctx
    mesh = ctx.mesh
    real = replace(ctx, mesh=real_mesh, device=cluster.device)
    result = extract(form, sol.choices, real, layers)
    abstract = ctx.device is None
    return Plan(
        model=name, graph_fingerprint=fingerprint, mesh_shape=tuple(mesh.shape),
        alpha=tuple(mesh.alpha), beta=tuple(mesh.beta), cluster=cluster_to_dict(cluster),
        method=method, optimizer=optimizer, ops=result.ops, params=result.params,
        sources=result.sources, collectives=result.collectives,
        objective=sol.objective - ctx.tie_break * ilp_memory(form, sol.choices),
        objective_units="alpha-beta units" if abstract else "seconds",
        search_time_s=search_time_s,
        ilp={"variables": sol.num_variables, "constraints": sol.num_constraints,
             "solve_time_s": sol.solve_time_s},
        predicted={"step_time_s": result.step_time_s,
                   "peak_memory_bytes": result.peak_memory_bytes} | result.figures,
        loss_partial_axes=result.loss_partial_axes, axis_weights=axis_weights,
        dtype=dtype, microbatches=ctx.microbatches, recompute=ctx.recompute,
        recompute_scope=(replay or FULL).scope, recompute_layers=(replay or FULL).layers,
        options={k: v for k, v in asdict(options).items()
                 if k not in ("memory_budget", "replicated_updates")}
        | {"replicated_updates": sorted(options.replicated_updates)}
        | {"memory_budget_bytes": budget, "unsupported_ops": list(unsupported_ops)},
        **(result.sync.fields() if result.sync else {}))
