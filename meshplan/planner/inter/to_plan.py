"""A chosen pipeline as a `Plan`: stages placed on the cluster, each stage's intra-operator plan
from the solve the profiler kept, the whole step's prediction (its schedule run on the
stages' compute and transfers, `schedule_time.py`).

Shared by every method that ends in a `PipelineSolution` priced by a `StageProfiler`: the
two-level search (`search.py`) and the hand-style pipelines (`manual.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshplan.cost.cluster import cluster_from_dict, cluster_to_dict
from meshplan.cost.mesh import logical_mesh
from meshplan.lower.pipeline_program import pipeline_exchanges
from meshplan.lower.stage_transfers import step_transfers
from meshplan.plan.plan import Plan, StagePlan
from meshplan.planner.inter.device_kinds import stage_hosts
from meshplan.planner.inter.placement import place_submeshes, share_a_host
from meshplan.planner.inter.schedule_time import scheduled_latency
from meshplan.planner.inter.stage_costs import StageProfiler, replay_of
from meshplan.planner.inter.stage_problem import PipelineSolution, StagePlacement
from meshplan.planner.intra.to_plan import intra_plan
from meshplan.planner.recompute import FULL
from meshplan.sim.task_costs import TransferCosts

if TYPE_CHECKING:  # search.py imports this module
    from meshplan.planner.inter.search import PipelineRequest


@dataclass
class FoundPipeline:
    """A pipeline a method chose, with the profiler that priced it (it holds the stages'
    solves) and the traced program's fingerprint and unsupported ops; ``estimated_s`` the
    DP's step time by parts when the solution's latencies are already the whole solves'."""

    solution: PipelineSolution
    profiler: StageProfiler
    fingerprint: str
    unsupported: tuple[str, ...]
    estimated_s: float | None = None


def stage_devices(sol: PipelineSolution, num_hosts: int, devices_per_host: int
                  ) -> list[tuple[int, ...]]:
    """The global device ids of each stage of ``sol``: typed stages on the hosts the DP laid
    them on, others by `place_submeshes`; under interleaving stage k runs on mesh k % S."""
    meshes = len(sol.stages) // sol.chunks
    if sol.hosts:
        per = devices_per_host
        placed = [tuple(h * per + j for h in hosts for j in range(per)) for hosts in
                  stage_hosts(sol.hosts, [s.submesh[0] for s in sol.stages[:meshes]])]
    else:
        placed = place_submeshes([s.submesh[:2] for s in sol.stages[:meshes]], num_hosts,
                                 devices_per_host)
    return [placed[k % meshes] for k in range(len(sol.stages))]


def inbound_discounts(prof: StageProfiler, sol: PipelineSolution,
                      devices: list[tuple[int, ...]], devices_per_host: int) -> list[float]:
    """Per stage, what its inbound transfer costs less than the profiler's price across hosts
    (`StageProfiler.link_discount`) where it and the stage before it share one host."""
    return [0.0] + [prof.link_discount(s.start, s.submesh)
                    if share_a_host(prev, here, devices_per_host) else 0.0
                    for prev, here, s in zip(devices, devices[1:], sol.stages[1:])]


def _split(prof: StageProfiler, stages: tuple[StagePlacement, ...], latencies: list[float],
           cuts: list[float]) -> tuple[list[float], list[float]]:
    """(compute, inbound transfer) seconds per micro-batch of ``stages`` whose latencies
    (inbound transfers included, less the ``cuts`` of `inbound_discounts`) are
    ``latencies``."""
    transfers = [prof.transfer_time(s.start) - cut for s, cut in zip(stages, cuts)]
    return [max(lat - x, 0.0) for lat, x in zip(latencies, transfers)], transfers


def scheduled_step(prof: StageProfiler, stages: tuple[StagePlacement, ...],
                   latencies: list[float], cuts: list[float], schedule: str, chunks: int
                   ) -> float:
    """The pipeline time of ``stages`` (`_split`) under ``schedule`` (interleaved when
    ``chunks`` > 1) as the runtime runs it (`schedule_time.scheduled_latency`). The first
    stage's inbound price, its batch's inputs, is no transfer: they are loaded where read."""
    return scheduled_latency(*_split(prof, stages, latencies, cuts), prof.microbatches,
                             "interleaved" if chunks > 1 else schedule, chunks)


def with_step_time(plan: Plan, compute: list[float], transfers: list[float]) -> Plan:
    """``plan``, a pipeline with its messages listed, with its step time: its schedule run on
    its stages' ``compute`` and inbound ``transfers`` seconds per micro-batch
    (`scheduled_latency`; the first stage's inputs are loaded, not sent), and the gradients of
    a parameter two stages hold (a tied embedding) crossing once before the update, on their
    links as the simulator prices them."""
    step = scheduled_latency(compute, transfers, plan.microbatches, plan.schedule, plan.chunks)
    step += TransferCosts(cluster_from_dict(plan.cluster), plan.microbatches,
                          plan.transfers).tied_s()
    return replace(plan, objective=step, predicted={**plan.predicted, "step_time_s": step})


def pipeline_plan(found: FoundPipeline, req: "PipelineRequest", seconds: float) -> Plan:
    """The `Plan` of ``found`` (``seconds``: the search's wall time). A pipeline of one stage
    is that stage's own intra-operator plan, listing itself as its one stage."""
    cl, sol, prof = req.cluster, found.solution, found.profiler
    meshes = len(sol.stages) // sol.chunks
    devices = stage_devices(sol, cl.num_hosts, cl.devices_per_host)
    discounts = inbound_discounts(prof, sol, devices, cl.devices_per_host)
    stages = []
    solved_all = prof.solutions([(s.start, s.end, s.submesh, s.option.label, s.in_flight)
                                 for s in sol.stages])
    solved_all = [replace(solved, latency=solved.latency - cut)
                  for solved, cut in zip(solved_all, discounts)]
    for i, (s, devs, solved) in enumerate(zip(sol.stages, devices, solved_all)):
        label = s.option.label
        replay = replay_of(label.kind, s.end - s.start)
        segments = prof.segments(solved.graph, s.end - s.start, label)
        form = replace(solved.form, ctx=replace(
            solved.form.ctx, recompute=label.recompute,
            recomputed=None if replay in (None, FULL) else frozenset(segments or ())))
        sub = prof.stage_cluster(f"{cl.name}[stage {i}]", s.submesh)
        plan = intra_plan(form, solved.solution, logical_mesh(sub, label.logical_shape), sub,
                          name=f"{req.name}[stage {i}]", fingerprint=solved.graph.fingerprint(),
                          method=req.method, optimizer=req.optimizer, options=req.options,
                          budget=req.budget, search_time_s=0.0, dtype=req.dtype,
                          unsupported_ops=found.unsupported, layers=segments, replay=replay)
        stages.append(StagePlan(i, (s.start, s.end), devs, s.submesh[:2], label.logical_shape,
                                label.recompute, s.in_flight, solved.latency,
                                solved.memory_bytes, plan,
                                recompute_scope=(replay or FULL).scope,
                                recompute_layers=(replay or FULL).layers,
                                tradeoffs=prof.tradeoffs(solved, s.start, s.end, label,
                                                         s.in_flight)))
    # The stages solved whole: their own latencies give the step time, not the DP's
    # estimates by parts.
    compute, transfers = _split(prof, sol.stages, [s.latency_s for s in stages], discounts)
    peak = max(math.fsum(s.memory_bytes for s in stages[i::meshes]) for i in range(meshes))
    estimate = sol.total_latency if found.estimated_s is None else found.estimated_s
    stats = {"estimated_step_s": estimate, "stage_solves": prof.solves, "tmax_tried": sol.stats.num_tmax_tried,
             "profile_calls": sol.stats.num_profile_calls, "dp_seconds": sol.stats.seconds}
    if len(stages) == 1:
        only = stages[0].plan
        assert only is not None
        return replace(only, model=req.name, graph_fingerprint=found.fingerprint,
                       cluster=cluster_to_dict(cl),
                       search_time_s=seconds, ilp=only.ilp | stats,
                       stages=(replace(stages[0], plan=None),),
                       num_layers=prof.layering.num_layers)
    mesh = logical_mesh(cl)
    plan = Plan(model=req.name, graph_fingerprint=found.fingerprint,
                mesh_shape=tuple(mesh.shape), alpha=tuple(mesh.alpha), beta=tuple(mesh.beta),
                cluster=cluster_to_dict(cl), method=req.method, optimizer=req.optimizer,
                ops=(), params=(), sources=(), collectives=(),
                objective=0.0, objective_units="seconds",
                search_time_s=seconds, ilp=stats,
                predicted={"peak_memory_bytes": peak},
                dtype=req.dtype, microbatches=prof.microbatches,
                recompute=any(s.recompute for s in stages), stages=tuple(stages),
                schedule="interleaved" if sol.chunks > 1 else req.dp_schedule,
                chunks=sol.chunks, num_layers=prof.layering.num_layers,
                options={"memory_budget_bytes": req.budget,
                         "unsupported_ops": list(found.unsupported)})
    # The messages between stages follow from the stage plans and the values' shapes.
    plan = replace(plan, transfers=step_transfers(plan, pipeline_exchanges(plan), prof.graph))
    return with_step_time(plan, compute, transfers)
