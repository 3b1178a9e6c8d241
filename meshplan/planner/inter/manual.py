"""Hand-style pipelines: one Megatron-LM configuration (``megatron:dp=D,tp=T,pp=P[,mb=M]``,
`megatron_spec.py`) or the fastest of every configuration a Megatron user would try
("megatron-grid"), priced on the cost model like the two-level search.

A configuration. The program is clustered into L layers (`clustering.py`) and cut into P equal
contiguous stages; L is the program's repeated-unit count n (a GPT's blocks, so a stage holds
n / P of them, as Megatron divides ``--num-layers`` by the pipeline size), or the user's
``num_layers``. Each stage runs on D·T devices (`stage_submesh`: part of one host, or whole
hosts) as the logical mesh (D, T) with the intra-op options of method "megatron": the batch on
axis 0, tensor parallelism on axis 1; parameter update modes (ZeRO) stay the ILP's choice, as
for that method. Device i·T + j sits at mesh position (i, j) (`cost/mesh.py`), so with T at
most a host's M devices and dividing it, axis 1's groups stay inside a host: tensor
parallelism on the fast link, data parallelism across hosts, as Megatron places them. The
micro-batch size M_b per replica makes B = global batch / (D·M_b) micro-batches; without it,
B is searched among the counts like "auto".

Its price. Each stage's options come from a `StageProfiler` that prices the mesh (D, T); each
stage takes its fastest option (recomputed or not, per ``recompute``) that fits its in-flight
micro-batches under the schedule (Alpa eq. 5). The step is Alpa eq. 2,
``T = sum_i t_i + (B - 1) max_i t_i``, which grows with every t_i, so the per-stage fastest
choices give the configuration's fastest step.

The grid. Every (dp, tp, pp) with dp·tp·pp = N, tp a power of two within a host, pp dividing
L; every micro-batch size a Megatron user tries: powers of two up to `MAX_MICRO_BATCH`
dividing the batch per replica. One capture and one `StageProfiler` per micro-batch count
serve all configurations of that count: the profiler caches each (layer structure, submesh,
logical shape) solve, so every pp and every (dp, tp) of one stage size share them.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasiblePlanError, MicrobatchError, NoPipelineError
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan
from meshplan.planner.inter.clustering import cluster_layers, default_num_layers, repeat_count
from meshplan.planner.inter.interleave import interleave
from meshplan.planner.inter.megatron_spec import (MegatronSpec, check_on_cluster,
                                                  stage_submesh)
from meshplan.planner.inter.search import (REFINE_MARGIN, REFINE_MAX, GraphFor,
                                          PipelineRequest, equal_stages, solved_as_whole)
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.inter.stage_problem import DpStats, make_solution
from meshplan.planner.inter.to_plan import FoundPipeline, pipeline_plan

MAX_MICRO_BATCH = 8  # Megatron's GPT recipes use micro-batches of 1-8 sequences per replica


def plan_megatron(graph_for: GraphFor, batch: int, spec: MegatronSpec, counts: list[int],
                  req: PipelineRequest) -> Plan:
    """The plan of one Megatron configuration (module docstring) for a global ``batch``; with
    no ``spec.mb``, the fastest over the micro-batch ``counts`` that give whole micro-batches
    per replica. Raises ValueError for a configuration that does not fit the cluster, the
    layers or the batch; InfeasiblePlanError when it does not fit the memory budget."""
    t0 = time.perf_counter()
    check_on_cluster(spec, req.cluster.num_hosts, req.cluster.devices_per_host)
    _check_schedule(spec, req)
    layers = partial(_layers_for, pp=spec.pp, req=req, virtual=spec.virtual)
    priced = (_price(_profiled(graph_for, b, req, layers, [spec]), spec.dp, spec.tp, spec.pp,
                     req, spec.virtual)
              for b in _runnable(graph_for, _counts_for(spec, batch, counts)))
    best, needs = None, []
    for found in _fewest_first(priced):
        if isinstance(found, NoPipelineError):
            needs.append(found.min_memory_bytes)
        else:
            best = found
    if best is None:
        raise _infeasible(min(needs), req, f"{spec}")
    mb = batch // (spec.dp * best.profiler.microbatches)
    return _with_config(pipeline_plan(best, req, time.perf_counter() - t0),
                        replace(spec, mb=mb), {})


def plan_megatron_grid(graph_for: GraphFor, batch: int, microbatches: int | None,
                       req: PipelineRequest) -> Plan:
    """The fastest Megatron configuration that fits (module docstring); ``microbatches``
    fixes the count (None: any). Raises ValueError when no configuration suits the cluster
    and batch, InfeasiblePlanError when none fits the memory budget."""
    t0 = time.perf_counter()
    cl = req.cluster
    by_count: dict[int, list[MegatronSpec]] = defaultdict(list)
    for spec in megatron_grid(cl.num_hosts, cl.devices_per_host, batch, microbatches):
        by_count[batch // (spec.dp * spec.mb)].append(spec)
    priced: list[tuple[FoundPipeline, MegatronSpec]] = []
    table, num_layers, solves = [], None, 0
    for b in sorted(by_count):
        specs = [s for s in by_count[b] if num_layers is None or num_layers % s.pp == 0]
        if not specs:
            continue
        try:
            profiled = _profiled(graph_for, b, req, partial(_grid_layers, req=req), specs)
        except MicrobatchError:
            if num_layers is None:   # the fewest micro-batches of any configuration
                raise
            break   # fewer samples a micro-batch than the model runs on: so are the rest
        num_layers = profiled.profiler.layering.num_layers
        for spec in (s for s in specs if num_layers % s.pp == 0):
            found = _price(profiled, spec.dp, spec.tp, spec.pp, req)
            table.append(_row(spec, found))
            if not isinstance(found, NoPipelineError):
                priced.append((found, spec))
        solves += profiled.profiler.solves
    if not table:
        fixed = "" if microbatches is None else f" in {microbatches} micro-batches"
        raise ValueError(f"no Megatron configuration of {cl.num_devices} devices splits a "
                         f"batch of {batch}{fixed} into micro-batches of at most "
                         f"{MAX_MICRO_BATCH} per replica")
    if not priced:
        raise _infeasible(min(r["memory_need_bytes"] for r in table), req,
                          f"{len(table)} Megatron configurations")
    best = _solved_best(priced, req)
    fit = sum(r["step_time_s"] is not None for r in table)
    plan = pipeline_plan(best[0], req, time.perf_counter() - t0)
    return _with_config(plan, best[1], {"stage_solves": solves, "configs_priced": len(table),
                                        "configs_fit": fit}, table)


def _solved_best(priced: list[tuple[FoundPipeline, MegatronSpec]], req: PipelineRequest
                 ) -> tuple[FoundPipeline, MegatronSpec]:
    """Of the configurations within `REFINE_MARGIN` of the best estimate (at most
    `REFINE_MAX`), the fastest with its stages solved whole that fits: the same judgement the
    search's own candidates get (`search._solved_whole`), so the grid is not handicapped by
    the by-parts estimate."""
    ranked = sorted(priced, key=lambda p: p[0].solution.total_latency)
    top = ranked[0][0].solution.total_latency
    budget = req.budget if req.budget is not None else math.inf
    best: tuple[FoundPipeline, MegatronSpec] | None = None
    for k, (found, spec) in enumerate(ranked[:REFINE_MAX]):
        if found.solution.total_latency > (1 + REFINE_MARGIN) * top:
            break
        whole, fits = solved_as_whole(found.profiler, found.solution, budget, req.dp_schedule)
        if (fits or not k) and (best is None or whole.total_latency
                                < best[0].solution.total_latency):
            best = (replace(found, solution=whole,
                            estimated_s=found.solution.total_latency), spec)
    assert best is not None
    return best


def megatron_grid(num_hosts: int, devices_per_host: int, batch: int,
                  microbatches: int | None = None) -> list[MegatronSpec]:
    """Every configuration of the grid (module docstring) on the cluster, before the layer
    count is known (pp is then restricted to its divisors); ``microbatches``, if given, fixes
    batch / (dp * mb)."""
    n, out = num_hosts * devices_per_host, []
    for pp in (p for p in range(1, n + 1) if n % p == 0):
        for tp in (t for t in _powers_of_two(devices_per_host) if (n // pp) % t == 0):
            dp = n // (pp * tp)
            if batch % dp or not _tiles(dp * tp, pp, num_hosts, devices_per_host):
                continue
            per_replica = batch // dp
            out += [MegatronSpec(dp, tp, pp, mb)
                    for mb in _powers_of_two(min(MAX_MICRO_BATCH, per_replica))
                    if per_replica % mb == 0
                    and microbatches in (None, per_replica // mb)]
    return out


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _tiles(stage_devices: int, pp: int, num_hosts: int, devices_per_host: int) -> bool:
    try:
        check_on_cluster(MegatronSpec(stage_devices, 1, pp), num_hosts, devices_per_host)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- layers


def _grid_layers(graph: Graph, req: PipelineRequest) -> int:
    """L of the grid: the user's ``num_layers``, else the repeated-unit count, else the
    search's default (pp then runs over L's divisors)."""
    if req.num_layers is not None:
        return req.num_layers
    n = repeat_count(graph)
    return n if n > 1 else default_num_layers(graph, req.cluster.num_devices)


def _layers_for(graph: Graph, pp: int, req: PipelineRequest, virtual: int = 1) -> int:
    """L for ``pp`` equal stages of ``virtual`` chunks each (pp·virtual equal chunks): the
    user's ``num_layers`` or the repeated-unit count, which the chunks must divide (Megatron's
    rule); without repetition the default L rounded up to a multiple of them. Raises
    ValueError naming the constraint and the valid sizes."""
    chunks = pp * virtual
    cut = f"pp={pp}" if virtual == 1 else \
        f"pp={pp} with virtual={virtual} ({chunks} chunks of layers, pp x virtual)"
    if req.num_layers is not None:
        if req.num_layers % chunks:
            raise ValueError(f"{cut} does not divide num_layers={req.num_layers}: the "
                             f"{'stages' if virtual == 1 else 'chunks'} would not hold equal "
                             "layers")
        return req.num_layers
    n = repeat_count(graph)
    if n > 1:
        if n % chunks:
            valid = [p for p in range(1, n + 1) if n % p == 0]
            what = "pp" if virtual == 1 else "pp x virtual"
            raise ValueError(f"{cut} does not divide the model's {n} repeated blocks, so the "
                             f"{'stages' if virtual == 1 else 'chunks'} would not hold equal "
                             f"blocks; valid {what}: {valid}")
        return n
    return math.ceil(default_num_layers(graph, req.cluster.num_devices) / chunks) * chunks


# ---------------------------------------------------------------- pricing


@dataclass(frozen=True)
class _Profiled:
    """One micro-batch count's traced program and the profiler pricing its stages."""

    profiler: StageProfiler
    fingerprint: str
    unsupported: tuple[str, ...]


def _profiled(graph_for: GraphFor, b: int, req: PipelineRequest,
              layers_for: Callable[[Graph], int], specs: list[MegatronSpec]) -> _Profiled:
    """The program at ``b`` micro-batches, clustered, and its profiler for ``specs``' meshes."""
    traced, fingerprint = graph_for(b)
    graph = with_compute_dtype(traced, req.dtype)
    layering = cluster_layers(graph, layers_for(graph))
    profiler = StageProfiler(graph, layering, req.cluster, req.options,
                             req.optimizer_state, b, req.budget, req.recompute,
                             logical_shapes=frozenset((s.dp, s.tp) for s in specs),
                             show_progress=req.progress, schedule=req.dp_schedule)
    return _Profiled(profiler, fingerprint, traced.unsupported_ops)


def _check_schedule(spec: MegatronSpec, req: PipelineRequest) -> None:
    """Raise ValueError when the schedule asked contradicts ``spec``'s interleaving."""
    if spec.virtual > 1 and req.schedule not in ("auto", "interleaved"):
        raise ValueError(f"{spec} interleaves {spec.virtual} chunks per stage (interleaved "
                         f"1F1B), but schedule {req.schedule!r} was asked: give schedule "
                         "'interleaved' or 'auto', or virtual=1")
    if spec.virtual == 1 and req.schedule == "interleaved":
        raise ValueError(f"schedule 'interleaved' needs virtual stages: give {spec},virtual=V "
                         "with V >= 2 chunks per stage")


def _price(profiled: _Profiled, dp: int, tp: int, pp: int, req: PipelineRequest,
           virtual: int = 1) -> FoundPipeline | NoPipelineError:
    """The pipeline of pp equal stages on (dp, tp) meshes (with ``virtual`` > 1: pp·virtual
    interleaved chunks, `interleave.py`), each stage's fastest option that fits; else a
    NoPipelineError with the memory the leanest options would need."""
    t0 = time.perf_counter()
    prof, b = profiled.profiler, profiled.profiler.microbatches
    per = prof.layering.num_layers // pp
    submesh = stage_submesh(dp * tp, req.cluster.devices_per_host)
    keep = (lambda o: o.label.logical_shape == (dp, tp))
    if virtual > 1:
        found = interleave(prof, [submesh] * pp, virtual, req.budget, keep)
        return found if isinstance(found, NoPipelineError) else \
            FoundPipeline(found, prof, profiled.fingerprint, profiled.unsupported)
    stages, need = equal_stages(prof, pp, per, submesh, b, req, keep=keep)
    if stages is None:
        return NoPipelineError(f"dp={dp},tp={tp},pp={pp} with {b} micro-batches does not fit",
                               req.budget, need)
    sol = make_solution(stages, b, DpStats(0, pp, time.perf_counter() - t0))
    return FoundPipeline(sol, prof, profiled.fingerprint, profiled.unsupported)


def _fewest_first(results: Iterator[FoundPipeline | NoPipelineError]
                  ) -> Iterator[FoundPipeline | NoPipelineError]:
    """``results`` (one per micro-batch count, fewest first) while they improve: each better
    pipeline, every failure, and stop once two counts in a row are no faster (the search's
    rule: more micro-batches only add per-micro-batch latency past the bubble's gain)."""
    best, worse = math.inf, 0
    for r in results:
        if isinstance(r, NoPipelineError):
            yield r
        elif r.solution.total_latency < best:
            best, worse = r.solution.total_latency, 0
            yield r
        else:
            worse += 1
            if worse == 2:
                return


def _runnable(graph_for: GraphFor, counts: list[int]) -> Iterator[int]:
    """``counts`` (fewest micro-batches first) up to the first whose micro-batch the model does
    not run on (MicrobatchError: fewer micro-batches hold more samples, so those before run);
    its error where it is the first."""
    for k, b in enumerate(counts):
        try:
            graph_for(b)
        except MicrobatchError:
            if k == 0:
                raise
            return
        yield b


def _counts_for(spec: MegatronSpec, batch: int, counts: list[int]) -> list[int]:
    """The micro-batch counts of ``spec`` for a global ``batch``: batch / (dp * mb), or those of
    ``counts`` giving each replica a whole micro-batch. Raises ValueError when there is none."""
    if batch % spec.dp:
        raise ValueError(f"{spec}: the global batch of {batch} does not split over dp={spec.dp} "
                         "replicas")
    per_replica = batch // spec.dp
    # Interleaving takes micro-batches in groups of the stages (Megatron-LM's rule).
    group = spec.pp if spec.virtual > 1 else 1
    if spec.mb is None:
        valid = [b for b in counts if per_replica % b == 0 and b % group == 0]
        if not valid:
            grouped = f" in multiples of pp={spec.pp}" if group > 1 else ""
            raise ValueError(f"{spec}: none of the micro-batch counts {counts} gives each of "
                             f"the {spec.dp} replicas a whole micro-batch of its "
                             f"{per_replica}{grouped}")
        return valid
    if per_replica % spec.mb:
        sizes = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        raise ValueError(f"{spec}: mb={spec.mb} does not divide the batch per replica, "
                         f"{batch} / dp={spec.dp} = {per_replica}; valid mb: {sizes}")
    if (per_replica // spec.mb) % group:
        sizes = [m for m in range(1, per_replica + 1)
                 if per_replica % m == 0 and (per_replica // m) % group == 0]
        raise ValueError(f"{spec}: interleaving needs the micro-batches per replica, "
                         f"{per_replica} / mb={spec.mb}, to be a multiple of pp={spec.pp}; "
                         f"valid mb: {sizes or 'none'}")
    return [per_replica // spec.mb]


# ---------------------------------------------------------------- result


def _row(spec: MegatronSpec, found: FoundPipeline | NoPipelineError) -> dict:
    ok = not isinstance(found, NoPipelineError)
    return spec.as_dict() | {
        "step_time_s": found.solution.total_latency if ok else None,
        "memory_need_bytes": max(s.option.memory_bytes(s.in_flight)
                                 for s in found.solution.stages) if ok
        else found.min_memory_bytes}


def _with_config(plan: Plan, spec: MegatronSpec, stats: dict, table: list | None = None
                 ) -> Plan:
    """``plan`` recording its Megatron configuration (and the grid's table) for `explain`."""
    options = plan.options | {"megatron": spec.as_dict()}
    if table is not None:
        options["megatron_grid"] = table
    return replace(plan, options=options, ilp=plan.ilp | stats)


def _infeasible(need: float, req: PipelineRequest, what: str) -> ValueError:
    """InfeasiblePlanError with the memory needed; ValueError when no stage had any plan."""
    if math.isinf(need):
        return ValueError(f"{what}: no stage plan on the cost model (the intra-op ILP is "
                          "infeasible under Megatron's constraints); try method 'auto'")
    assert req.budget is not None, "without a budget every stage with a plan fits"
    return InfeasiblePlanError(
        req.budget, need,
        f"Priced {what} with recomputation '{req.recompute}' and the '{req.schedule}' "
        "schedule; more tensor or pipeline parallelism, a smaller micro-batch size (mb), "
        "method 'megatron-grid' or 'auto', or a larger budget may fit.")
