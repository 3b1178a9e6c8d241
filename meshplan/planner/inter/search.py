"""The two-level search (Alpa §5): operator clustering, stage costs from the intra-op ILP, the
stage–submesh DP, and the number of micro-batches around them; the result as a `Plan`.

For each micro-batch count B tried, the program traced at the micro-batch's size is clustered
into L layers (`clustering.py`), every layer range is priced on every submesh and logical shape
(`stage_costs.py`) and the DP picks the stages (`stage_dp.py`, Alpa eq. 2-5, 1F1B's in-flight
micro-batches in the memory check). With per-micro-batch latency t(b) = c + k·b for b samples,
eq. 2 gives T(B) = (S + B - 1)·(c + k·batch / B): more micro-batches shrink the bubble and the
activations kept until the fixed cost c of each dominates, so T is convex in B and the fastest
count is usually a large one for a large model. Counts are therefore tried from the most
micro-batches down, stopping at the first that is no faster (beyond Alpa, which takes B from the
user); counts whose micro-batches no plan without recomputation could fit (the memory
floor, `memory_floor.py`) are not profiled: a pruning rule, not a bound, where stages may
recompute (a replayed stage holds one layer's activations at a time), kept because the
counts of the largest micro-batches are the slowest to price (MoE-70B on 64 V100s at 16
micro-batches, below the floor: over 12 minutes of pricing, not finished). Under
"auto", a count whose fastest pipeline is one stage ends the walk down: fewer micro-batches
only grow the pipelines' bubbles, and one stage at the fewest count that fits
is weighed beside the search (`api._weighs_intra_only`). Once a micro-batch is smaller than
the devices it is spread over, c grows (one sample cannot be split), so the walk also starts
from the most micro-batches that still give each device a sample, and goes both ways from
there while it gains (also after a walk ended at one stage). A pipeline of one stage is
returned as that stage's own intra-op plan.

Bounds before prices. Where memory binds, most of a count's pricing is the plans that trade
speed for memory ("lean", "deep": `stage_costs.py`). The DP first weighs lower bounds of them
(`StageProfiler.estimates`); the variants its best pipeline uses are priced and it runs again,
until that pipeline uses no bound, or, in a walk, until its bound already loses to the count
before (`_settled`); the counts solved whole are searched on until every pipeline they weigh
is priced. Each answer is the one pricing everything gives (`tests/test_deferred_variants.py`):
MoE-70B on 64 V100 walks its counts in 11-26 s each instead of 23-38, the one its walk stops at
on "free" prices alone.

Estimates and whole solves. The DP prices a long stage as the sum of its one-layer plans, which
misjudges it by a few per cent either way (a whole solve shares layouts across layer boundaries
and balances memory against time across the stage). So the walk compares estimates, and at the
end the counts within `REFINE_MARGIN` of the best estimate have their near-best pipelines (the
DP's own and the best of equal stages per stage count) solved whole, each stage on the logical
mesh that solves fastest, and the fastest that fits is the plan (`_solved_best`).

Scale. On up to `HOST_GRANULAR_ABOVE` hosts (Alpa's testbed has 8) the submeshes are Alpa's:
(1, 2^k) within a host and (k, M) for every k, each with every logical shape. Beyond that the
search is host-granular: stages take whole hosts, (k, M) for k a power of two, a divisor of
the host count (equal stages that tile the cluster: Megatron-LM's 1T runs 64 stages of 6 hosts
on 384) or the whole cluster, with the tensor axis of their logical mesh inside a host
(Alpa's own default logical space; Megatron-LM finds tensor parallelism across hosts slow). A
stage of 1536 GPUs has 30 logical shapes and a cluster of 192 hosts 191 (k, M) shapes; pricing
each is what would not scale, while a pipeline over hundreds of GPUs gains nothing from stages
of a few.

Links. Stages are laid on contiguous devices in pipeline order, so the DP knows which
boundaries lie inside a host (the two stages share it: the transfer runs over the devices' own
links) and which cross hosts, and prices each on its link (`stage_problem.Links`); it only
picks shapes that can be laid so. Host-granular and typed searches cross hosts at every
boundary and keep the price across hosts.

Alpa's ablations: "inter-only" plans each stage data parallel only (pipeline + data
parallelism); "equal-layer" cuts the layers into S equal stages on N/S devices each, for the
best S, instead of the DP's uneven stages; "equal-operator" clusters layers of equal op counts
instead of eq. 6 (`clustering.py`), then runs the same DP. Hand-style pipelines (Megatron-LM's
dp x tp x pp) are priced in `manual.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from meshplan.cost.cluster import Cluster
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasiblePlanError, MicrobatchError, NoPipelineError
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan
from meshplan.planner.inter.clustering import cluster_layers, default_num_layers
from meshplan.planner.inter.device_kinds import host_types, kind_layouts, kind_types
from meshplan.planner.inter.interleave import MAX_CHUNKS, chunk_counts, interleave
from meshplan.planner.inter.stage_costs import StageLabel, StageProfiler, usable_cores
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_problem import (ClusterShape, DpStats, Links,
                                                  PipelineProblem,
                                                  PipelineSolution, Profile, StageOption,
                                                  StagePlacement, Submesh,
                                                  gpipe, linked, make_solution, one_f_one_b,
                                                  submesh_shapes)
# The result of a search and its Plan, shared with the hand-style pipelines (`manual.py`).
from meshplan.planner.inter.to_plan import (FoundPipeline, inbound_discounts, pipeline_plan,
                                            scheduled_step, stage_devices)
from meshplan.planner.intra.choices import IntraOptions
from meshplan.planner.memory_floor import CountFloors

# Micro-batches each schedule keeps in flight on a stage (the DP's memory check). Both have the
# same latency (Alpa eq. 2); 1F1B keeps fewer, so "auto" is 1F1B.
SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


SCHEDULE_CHOICES = ("auto", "1f1b", "gpipe", "interleaved")


def resolve_schedule(schedule: str) -> str:
    """``schedule`` checked: "auto" (1F1B, or interleaved 1F1B when the planner finds it
    faster), "1f1b", "gpipe" or "interleaved" (virtual stages, as many as is fastest). Raises
    ValueError for another."""
    if schedule not in SCHEDULE_CHOICES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULE_CHOICES)}")
    return schedule


# Clusters of more hosts are planned host-granular (module docstring).
HOST_GRANULAR_ABOVE = 8
# Pipelines whose estimate is within this fraction of the best one's are solved whole, at most
# REFINE_MAX of them (`_solved_whole`).
REFINE_MARGIN = 0.08
REFINE_MAX = 3
# Memory-trading variants priced only where the pipelines that may win use them (`_settled`).
LAZY_VARIANTS = True

# (traced graph at one micro-batch's size, its fingerprint) for a micro-batch count.
GraphFor = Callable[[int], tuple[Graph, str]]


@dataclass(frozen=True)
class PipelineRequest:
    """What the search needs besides the program: the cluster and the training step."""

    cluster: Cluster
    options: IntraOptions
    optimizer: dict
    optimizer_state: OptimizerState
    budget: float | None
    dtype: str
    num_layers: int | None = None
    name: str = "model"
    method: str = "auto"
    recompute: str = "auto"
    schedule: str = "1f1b"   # one of SCHEDULE_CHOICES
    progress: bool = False   # progress bars on stderr (when it is a terminal)

    @property
    def dp_schedule(self) -> str:
        """The schedule the stage DP prices (interleaving is decided after it, on its
        meshes): GPipe if asked, else 1F1B."""
        return "gpipe" if self.schedule == "gpipe" else "1f1b"


def search_pipeline(graph_for: GraphFor, counts: list[int], req: PipelineRequest) -> Plan:
    """The fastest pipeline over the micro-batch ``counts`` (module docstring). Raises
    InfeasiblePlanError when no count gives a plan that fits."""
    t0 = time.perf_counter()
    search = _CountSearch(graph_for, _runnable(graph_for, sorted(counts)), req)
    top = len(search.counts) - 1
    search.walk(top, -1)
    probe = search.probe
    if probe is not None and probe not in search.tried and search.fits(probe):
        before = search.best_latency()
        if search.latency(probe, before) < before:
            search.walk(probe - 1, -1, search.latency(probe))
            search.walk(probe + 1, +1, search.latency(probe))
    best = _solved_best(search, req)
    if best is None:
        raise _infeasible(search.errors, counts, req)
    found = interleaved_if_chosen(best, req)
    plan = pipeline_plan(found, req, time.perf_counter() - t0)
    if plan.num_stages > 1 and _weighs_one_stage(req) and not found.solution.hosts:
        plan = _one_stage_if_simulated_faster(plan, found, req, t0)
    return plan


def _runnable(graph_for: GraphFor, counts: list[int]) -> list[int]:
    """``counts`` (ascending) up to the most micro-batches whose micro-batch the model runs on
    (batch norm needs two values per channel: a Wide-ResNet on 32-pixel images, batch 8, fails
    at one sample a micro-batch). The walk starts from the most, so this traces nothing it
    would not; fewer micro-batches hold more samples, so the counts below run too. Raises the
    MicrobatchError of the fewest where none runs."""
    top = len(counts)
    while True:
        try:
            graph_for(counts[top - 1])
            return counts[:top]
        except MicrobatchError:
            top -= 1
            if top == 0:
                raise


# The methods whose search may answer one stage over every device.
ONE_STAGE_METHODS = ("auto", "inter-only", "equal-operator")


def _weighs_one_stage(req: PipelineRequest) -> bool:
    """Whether the search itself weighs one stage over every device against its pipelines:
    for `ONE_STAGE_METHODS`. Also "auto" on one host, where `api.plan` weighs intra-only's
    plan as well (one stage at the fewest micro-batches that fit): under a tight budget one
    stage at the pipeline's count can fit a plan that communicates less (GPT-1.3B on four
    V100s: one stage at 256 micro-batches 27.75 s, intra-only's at 128 28.06, the pipeline
    28.05)."""
    return req.method in ONE_STAGE_METHODS


# Whole solves of the one stage `_one_stage_if_simulated_faster` tries at most.
ONE_STAGE_TRIES = 3
# One stage is weighed against the pipeline as simulated only where its fastest estimate by
# parts is under this many times the pipeline's prediction: beyond, neither error could close
# the gap (a stage solved whole has come out up to 14 % under its estimate by parts, MoE-70B
# at 256 micro-batches; the pipelines' predictions are within 5 % of the simulator on the
# weak-scaling suite's rows), and simulating a long pipeline costs seconds (GPT-3 175B on
# 1,024 A100s: 72 stages of 1,536 micro-batches, 3.5 of the search's 30 s).
ONE_STAGE_WITHIN = 1.5


def _one_stage_if_simulated_faster(plan: Plan, found: FoundPipeline, req: PipelineRequest,
                                   t0: float) -> Plan:
    """``plan`` (a pipeline of ``found``), or one stage over every device when that is faster
    than the pipeline as the simulator runs it. Eq. 2 leaves out what a pipeline moves between
    its stages: the activations and gradients at every boundary, and the gradients of a
    parameter two stages share (a tied embedding), exchanged before the update — on a slow
    network seconds the DP never saw. The simulator runs them; when its step is longer than
    one stage's could be (its by-parts estimate), that stage is solved whole. Where one stage's
    estimate is `ONE_STAGE_WITHIN` times the pipeline's prediction or more, neither is run."""
    from meshplan.sim.simulate import simulate   # the simulator reads plans: not at import
    prof, cl = found.profiler, req.cluster
    options = prof(0, prof.layering.num_layers, (cl.num_hosts, cl.devices_per_host))
    fastest = min((o.latency for o in options), default=math.inf) * prof.microbatches
    if fastest >= ONE_STAGE_WITHIN * plan.predicted["step_time_s"]:
        return replace(plan, options={**plan.options, "pipeline_check": {
            "pipeline_estimated_s": plan.predicted["step_time_s"],
            "one_stage_estimated_s": fastest}})
    simulated = simulate(plan).step_time_s
    record = {"pipeline_estimated_s": plan.predicted["step_time_s"],
              "pipeline_simulated_s": simulated}
    one = _one_stage_below(found, req, simulated, options)
    if one is None:
        return replace(plan, options={**plan.options, "pipeline_check": record})
    single = pipeline_plan(replace(found, solution=one, estimated_s=None), req,
                           time.perf_counter() - t0)
    # A stage's latency leaves out the update, which one stage's own plan prices: compare
    # the plans (one stage's prediction is its simulation).
    record["one_stage_s"] = single.predicted["step_time_s"]
    chosen = single if record["one_stage_s"] < simulated else plan
    return replace(chosen, options={**chosen.options, "pipeline_check": record})


def _one_stage_below(found: FoundPipeline, req: PipelineRequest, bound: float,
                     options: tuple[StageOption, ...]) -> PipelineSolution | None:
    """The fastest one-stage pipeline over every device, solved whole, that fits the budget
    and takes less than ``bound`` seconds per step; None if none does. Tries the few stage
    of its ``options`` (logical mesh, recomputation, memory variant, priced by parts) whose
    estimate is below the bound, fastest first."""
    prof, cl = found.profiler, req.cluster
    last, full = prof.layering.num_layers, (cl.num_hosts, cl.devices_per_host)
    budget = req.budget if req.budget is not None else math.inf
    options = sorted((o for o in options if o.latency * prof.microbatches < bound),
                     key=lambda o: o.latency)
    best = None
    for o in options[:ONE_STAGE_TRIES]:
        solved = prof.solutions([(0, last, full, o.label, 1)])[0]
        if solved.memory_bytes > budget:
            continue
        one = make_solution((StagePlacement(0, last, full, replace(o, latency=solved.latency),
                                            1),), prof.microbatches, found.solution.stats)
        if one.total_latency < bound and (best is None or
                                          one.total_latency < best.total_latency):
            best = one
    return best


def interleaved_if_chosen(best: FoundPipeline, req: PipelineRequest,
                          keep: Callable[[StageOption], bool] = lambda o: True
                          ) -> FoundPipeline:
    """``best`` (a 1F1B pipeline) or, under schedule "auto" when faster and under
    "interleaved" always, the fastest interleaved pipeline on its meshes that fits, solved
    whole (`interleave.py`). Raises ValueError when "interleaved" is asked and ``best``
    cannot interleave, InfeasiblePlanError when no interleaving fits."""
    if req.schedule not in ("auto", "interleaved"):
        return best
    sol, prof = best.solution, best.profiler
    meshes = [s.submesh for s in sol.stages]
    layers, b = prof.layering.num_layers, prof.microbatches
    counts = chunk_counts(layers, len(meshes), b)
    must = req.schedule == "interleaved"
    if not counts:
        if not must:
            return best
        raise ValueError(
            f"interleaved 1F1B cannot split the best pipeline ({len(meshes)} stage"
            f"{'s' if len(meshes) != 1 else ''}, {layers} layers, {b} micro-batches): it needs "
            f"at least 2 stages, the micro-batches a multiple of the stages and the layers a "
            f"multiple of stages x chunks (2-{MAX_CHUNKS}); give num_layers or microbatches "
            "that allow it, a megatron:...,virtual=V method, or schedule 'auto'")
    budget = req.budget if req.budget is not None else math.inf
    chosen, errors = None, []
    for v in counts:
        found = interleave(prof, meshes, v, req.budget, keep)
        if isinstance(found, NoPipelineError):
            errors.append(found)
            continue
        whole, fits = solved_as_whole(prof, found, budget, req.dp_schedule)
        if fits and (chosen is None or whole.total_latency < chosen[0].total_latency):
            chosen = (whole, found.total_latency)
    if chosen is None:
        if must:
            need = min((e.min_memory_bytes for e in errors), default=math.inf)
            raise InfeasiblePlanError(
                budget, need, f"No interleaving ({counts} chunks) of the best pipeline's "
                f"{len(meshes)} stages fits: interleaving keeps more micro-batches in flight "
                "than 1F1B; use schedule '1f1b' or 'auto', or a larger budget.")
        return best
    if must or chosen[0].total_latency < sol.total_latency:
        return replace(best, solution=replace(chosen[0], hosts=sol.hosts),
                       estimated_s=chosen[1])
    return best


@dataclass(frozen=True)
class _Searched:
    """One micro-batch count's search: the pipelines its DPs found, estimated by parts, and the
    best of them by that estimate. Searched only as far as a walk needed (`_settled`), the
    estimate is a lower bound (``bound``) that ``again(stop)`` searches further;
    ``again(math.inf, True)`` prices every candidate `_whole_round` weighs (``whole``)."""

    found: FoundPipeline
    candidates: tuple[PipelineSolution, ...]
    # The DPs again with another budget per device (`_refitted`).
    redo: Callable[[float | None], tuple[PipelineSolution, ...]] | None = None
    bound: bool = False   # ``estimate`` only bounds the count's from below
    whole: bool = True    # the candidates `_whole_round` weighs are priced (`_settled`)
    again: Callable[[float, bool], "_Searched"] | None = None

    @property
    def estimate(self) -> float:
        return self.found.solution.total_latency


def _solved_best(search: "_CountSearch", req: PipelineRequest) -> FoundPipeline | None:
    """The fastest pipeline solved whole (`_solved_whole`) over the counts whose best estimate
    is within `REFINE_MARGIN` of the best one's: the walk compares estimates, the plan the
    stages as they solve. The counts are solved fastest estimate first, and once one has a
    plan that fits, a count is solved only while its estimate is also within the margin of
    that plan's solved figure: the margin is what an estimate by parts may misjudge, and the
    solved figure is what it would have to beat (GPT-39B on 64 V100: 1024 micro-batches
    estimated 78.51 s and solved 76.98; 512 estimated 84.76, within 8 % of the first estimate
    but not of 76.98, and solved 82.84 without fitting, then refitted: 40 of the search's
    170 s)."""
    pending = {i for i, t in search.tried.items() if t is not None}
    if not pending:
        return None
    top: float | None = None
    best: FoundPipeline | None = None
    best_fits = False
    while pending:
        # Fastest estimate first; a count searched only as far as its walk needed is searched
        # on when it comes first, and takes its place again (its estimate can only grow).
        i = min(pending, key=lambda i: (search.tried[i].estimate, i))
        t = search.tried[i]
        if top is not None:
            bound = min(top, best.solution.total_latency) if best_fits and best else top
            if t.estimate > (1 + REFINE_MARGIN) * bound:
                break
        if not t.whole:
            search.search_whole(i)
            if search.tried[i] is None:
                pending.discard(i)
            continue
        pending.discard(i)
        top = t.estimate if top is None else top
        profiler = t.found.profiler
        sol, fits = _solved_whole(profiler, _whole_round(profiler, list(t.candidates), req),
                                  req)
        if not fits:
            sol, fits = _refitted(t, req, sol)
        if _weighs_one_stage(req):
            sol = _one_stage_if_faster(profiler, sol, req)
        if best is None or (fits, -sol.total_latency) > (best_fits,
                                                         -best.solution.total_latency):
            best, best_fits = replace(t.found, solution=sol, estimated_s=t.estimate), fits
    return best


# Rounds of `_refitted`.
REFIT_ROUNDS = 3


def _refitted(searched: _Searched, req: PipelineRequest, solved: PipelineSolution
              ) -> tuple[PipelineSolution, bool]:
    """A pipeline of the count that fits as it runs, when none of its candidates solved whole
    did. The DP fits stages by parts, the whole solves by the peak the simulator walks (the
    op-by-op transients beyond the ILP's live sets); where those exceed what the DP left,
    every candidate can be over. So the DPs run again with the budget less the excess found,
    a few rounds, and their candidates are solved whole; else ``solved`` as it was (the plan
    then reports its peak). GPT-39B on 64 V100: simulated 17.75 GiB on 16 GiB devices."""
    if searched.redo is None or req.budget is None:
        return solved, False
    profiler, dp_budget = searched.found.profiler, req.budget
    for _ in range(REFIT_ROUNDS):
        excess = _peak_over_budget(profiler, solved, req.budget)
        dp_budget = dp_budget / max(excess, 1.0 + 1e-3)
        try:
            again = searched.redo(dp_budget)
        except NoPipelineError:
            break
        solved, fits = _solved_whole(profiler, _whole_round(profiler, list(again), req), req)
        if fits:
            return solved, True
    return solved, False


def _peak_over_budget(profiler: StageProfiler, pipeline: PipelineSolution, budget: float
                      ) -> float:
    """The largest mesh's peak as run (whole solves, transients included) over ``budget``."""
    memory = [profiler.whole_cost(*r)[1] for r in _whole_requests(profiler, pipeline)]
    return max(mesh_memory(memory, pipeline.chunks)) / budget


# The walk traces counts ahead only where the search prices on more cores than this (`ahead`):
# on one, the trace has no idle core to take.
AHEAD_ABOVE_CORES = 1


class _CountSearch:
    """Micro-batch counts tried, each at most once (`latency`), with a memory floor that skips
    counts no plan could fit (`fits`)."""

    def __init__(self, graph_for: GraphFor, counts: list[int], req: PipelineRequest) -> None:
        self.graph_for, self.counts, self.req = graph_for, counts, req
        self.tried: dict[int, _Searched | None] = {}
        self.errors: list[NoPipelineError] = []
        # Past some count the micro-batch no longer spreads over the devices (one sample
        # cannot be data parallel), which breaks the convexity of eq. 2: the search also
        # starts from the most micro-batches that still give every device a sample
        # (`search_pipeline`), and walks both ways from there.
        self.probe = max((i for i, b in enumerate(counts)
                          if counts[-1] // b >= req.cluster.num_devices), default=None)
        # The floor of plans that do not recompute, whatever ``req.recompute`` allows (module
        # docstring).
        self._floors = CountFloors(lambda b: graph_for(b)[0], req.dtype, req.optimizer_state,
                                   req.cluster.num_devices, req.budget, recompute=False)

    def fits(self, i: int) -> bool:
        """Whether count ``i`` passes the memory floor (`memory_floor.CountFloors`)."""
        b = self.counts[i]
        if self._floors.may_fit(b):
            return True
        if b in self._floors.traced:   # (not where extrapolated: the traced ones say more)
            self.errors.append(NoPipelineError("below the memory floor", self.req.budget,
                                               self._floors.traced[b]))
        return False

    def latency(self, i: int, stop: float = math.inf) -> float:
        """The fastest pipeline's latency at count ``i`` (inf when none fits), or a lower
        bound of it at least ``stop`` where that settles the question asked (`_settled`)."""
        try:
            if i not in self.tried:
                self.tried[i] = _search_one(self.graph_for, self.counts[i], self.req, stop) \
                    if self.fits(i) else None
            searched = self.tried[i]
            if searched is not None and searched.bound and searched.estimate < stop:
                self.tried[i] = searched = searched.again(stop)
        except NoPipelineError as e:
            self.errors.append(e)
            self.tried[i] = searched = None
        return math.inf if searched is None else searched.estimate

    def search_whole(self, i: int) -> None:
        """Count ``i`` searched on until the candidates `_whole_round` weighs are priced."""
        searched = self.tried[i]
        assert searched is not None and searched.again is not None
        try:
            self.tried[i] = searched.again(math.inf, True)
        except NoPipelineError as e:
            self.errors.append(e)
            self.tried[i] = None

    def walk(self, i: int, step: int, previous: float = math.inf) -> None:
        """Counts ``i``, ``i + step``, ... while each is faster than the one before. Going
        down, a count that cannot fit ends the walk (fewer micro-batches hold more), and so
        does one whose fastest pipeline is one stage where one stage at fewer micro-batches
        is weighed anyway (`_one_stage_ends`)."""
        while 0 <= i < len(self.counts) and i not in self.tried:
            self.ahead(i + step)
            t = self.latency(i, previous)
            self._probe_ahead()
            if t >= previous or (t == math.inf and step < 0):
                return
            if step < 0 and self._one_stage_ends(i):
                return
            previous, i = t, i + step

    def _probe_ahead(self) -> None:
        """Have the probe traced beside the walk (the walk down seldom reaches it, and it is
        then searched: BERT-MoE on HAP's cluster, 32 of 2048 micro-batches, 0.9 s to trace),
        below the count the walk asks for next (a count under way stays as it was started),
        once its floor can be extrapolated from two counts traced (GPT-3 175B's probe, one
        micro-batch of the whole batch, is well over the budget and never searched)."""
        if self.probe is not None and (self.req.budget is None
                                       or len(self._floors.traced) >= 2):
            self.ahead(self.probe, "idle")

    def ahead(self, i: int, priority: str = "nice") -> None:
        """Have count ``i``'s program traced ahead, where the walk may come to it next and
        ``graph_for`` can (`capture/ahead.py`): not where its floor, extrapolated, skips it,
        nor where the search prices on `AHEAD_ABOVE_CORES` cores or fewer. The trace runs
        at the lowest priority (`forked.NICENESS`), on the cycles the pricing's serial
        steps leave idle: at the normal one it took a share of the cores where the pricing
        runs on all of them (on 2, BERT-MoE on HAP's cluster searched 217.6 -> 239.1 s with
        traces ahead, session 71); niced, on 2 cores, BERT-MoE 80.6 -> 73.1 s, GPT-3 175B on
        1024 A100s 34.1 -> 30.1 s (session 77). ``priority``: `forked.PRIORITIES`."""
        ahead = getattr(self.graph_for, "ahead", None)
        if ahead is not None and usable_cores() > AHEAD_ABOVE_CORES \
                and 0 <= i < len(self.counts) \
                and i not in self.tried and not self._floors.skips_untraced(self.counts[i]):
            ahead(self.counts[i], priority)

    def _one_stage_ends(self, i: int) -> bool:
        """Whether one stage won at count ``i`` under "auto", whose one stage at the fewest
        micro-batches that fit is weighed beside the search (`api._weighs_intra_only`): going
        down, every pipeline's bubble grows while one stage has none to lose, so the counts
        below ``i`` are left to that plan (when the options open every strategy to a larger
        batch: `IntraOptions.grows_with_batch`), not searched one by one. The probe of
        `search_pipeline` still runs: where a micro-batch gives every device a sample, one
        stage may again be faster than both (MoE-2.4B's widths on 8 V100s: one stage at 16
        micro-batches, 0.0310 s estimated; at the probe's 2, 0.0290, and solved whole 0.0267 s
        simulated, against intra-only's 0.0284)."""
        searched = self.tried.get(i)
        return self.req.method == "auto" and self.req.options.grows_with_batch and \
            searched is not None and len(searched.found.solution.stages) == 1

    def best_latency(self) -> float:
        # A count known by a bound has it at least the latency of the count that stopped
        # its walk: the least estimate is an exact one.
        return min((t.estimate for t in self.tried.values() if t is not None),
                   default=math.inf)


def _infeasible(errors: list[NoPipelineError], counts: list[int], req: PipelineRequest
                ) -> InfeasiblePlanError:
    need = min(e.min_memory_bytes for e in errors)
    if need == math.inf:   # no pipeline at all, whatever the memory
        return InfeasiblePlanError(
            math.inf if req.budget is None else req.budget, need,
            f"every split of the layers into stages on submeshes of the {req.cluster.num_devices} "
            f"devices, with {counts[0]}-{counts[-1]} micro-batches, leaves some stage without "
            f"a plan that method {req.method!r} allows; use method 'auto' or 'intra-only', "
            "or a larger batch")
    assert req.budget is not None, "without a budget some pipeline always fits"
    return InfeasiblePlanError(
        req.budget, need,
        f"Searched pipelines of up to {req.cluster.num_devices} stages with "
        f"{counts[0]}-{counts[-1]} micro-batches, recomputation and ZeRO; use more devices, "
        "a smaller global batch or a larger budget.")


def _search_one(graph_for: GraphFor, b: int, req: PipelineRequest, stop: float = math.inf
                ) -> _Searched:
    """Count ``b``'s pipelines (`_Searched`), searched until its best is priced, or until a
    lower bound of it is at least ``stop`` (`_settled`)."""
    traced, fingerprint = graph_for(b)
    graph = with_compute_dtype(traced, req.dtype)
    cl = req.cluster
    num_layers = req.num_layers or default_num_layers(graph, cl.num_devices)
    layering = cluster_layers(graph, num_layers,
                              balance="ops" if req.method == "equal-operator" else "flops")
    # Hosts of several device types: typed stages in whole hosts (`device_kinds.py`).
    types = host_types(cl)
    kinds = kind_types(types, req.dtype) if types else ()
    by_hosts = cl.num_hosts > HOST_GRANULAR_ABOVE or bool(kinds)
    profiler = StageProfiler(graph, layering, cl, req.options, req.optimizer_state, b,
                             req.budget, req.recompute, show_progress=req.progress,
                             tensor_within_host=by_hosts, kinds=kinds,
                             schedule=req.dp_schedule, lazy=LAZY_VARIANTS)
    # The DP's view of the cluster: its devices, or in host-granular mode its hosts (a
    # "device" of the DP is a whole host; submesh (1, k) of it is (k, M) of the cluster).
    shape = ClusterShape(1, cl.num_hosts, divisor_widths=not kinds) if by_hosts else \
        ClusterShape(cl.num_hosts, cl.devices_per_host)
    def real(sub: Submesh) -> Submesh:
        # A stage spanning kinds is priced as the slowest device: the untyped submesh's price.
        typed = sub[2:] if len(sub) > 2 and sub[2] < len(kinds) else ()
        return (sub[1], cl.devices_per_host, *typed) if by_hosts else (*sub[:2], *typed)
    layouts = kind_layouts(types, kinds) if kinds else [((), None)]
    dp_shapes = submesh_shapes(shape)
    if kinds:
        dp_shapes = dp_shapes + layouts[0][1].shapes(dp_shapes)
    profiler.prefetch(tuple(dict.fromkeys(real(sub) for sub in dp_shapes)))
    whole: Profile = (lambda start, end, sub: profiler.estimates(start, end, real(sub)))
    # Each boundary priced on its link, stages laid in order (`Links`): where the DP's
    # devices are devices, untyped (typed stages and whole hosts cross hosts anyway).
    links = None if by_hosts else \
        Links(lambda start, sub: profiler.link_discount(start, real(sub)))
    def candidates(budget: float | None) -> tuple[PipelineSolution, ...]:
        """The DPs' pipelines with ``budget`` bytes per device (raises NoPipelineError)."""
        req_at = replace(req, budget=budget)
        if budget is not None:
            profiler.bind_below(budget)
        # Equal stages (Alpa's "equal layer" pipelines, Megatron's) are candidates of every
        # method: by parts their long stages may look slower than they solve.
        searches: list[Callable[[], PipelineSolution]] = [
            partial(_equal_stages, whole, num_layers, n, shape, b, req_at, links)
            for n in _stage_counts(num_layers, shape, req.method != "equal-layer")]
        if req.method != "equal-layer":
            for hosts, layout in layouts:
                problem = PipelineProblem(
                    shape, num_layers, whole, b, device_memory=budget,
                    in_flight=SCHEDULES[req.dp_schedule], kinds=layout, links=links,
                    table=lambda subs: profiler.option_table(tuple(real(sub) for sub in subs)))
                searches.insert(0, partial(_with_hosts, problem, hosts))
        found, errors = [], []
        for search in searches:
            try:
                sol = search()
            except NoPipelineError as e:
                errors.append(e)
                continue
            found.append(replace(sol, stages=tuple(replace(s, submesh=real(s.submesh))
                                                   for s in sol.stages)))
        if not found:
            raise min(errors, key=lambda e: e.min_memory_bytes)
        return tuple(found)

    def searched(stop: float, whole: bool = False,
                 found: tuple[PipelineSolution, ...] | None = None) -> _Searched:
        found, state = _settled(profiler, partial(candidates, req.budget), stop, whole, found)
        best = min(found, key=lambda s: s.total_latency)
        return _Searched(FoundPipeline(best, profiler, fingerprint, traced.unsupported_ops),
                         found, lambda budget: _settled(profiler, partial(candidates, budget))[0],
                         bound=state == "bound", whole=state == "whole",
                         again=lambda stop, whole=False: searched(stop, whole, found))

    return searched(stop)


def _settled(profiler: StageProfiler, candidates: Callable[[], tuple[PipelineSolution, ...]],
             stop: float = math.inf, whole: bool = True,
             found: tuple[PipelineSolution, ...] | None = None
             ) -> tuple[tuple[PipelineSolution, ...], str]:
    """The DPs' pipelines (``candidates()``) with the deferred variants they use priced
    (`StageProfiler.reveal`), round by round, as far as the question needs: the best
    pipeline's ("best"), or a lower bound of it once that is at least ``stop`` ("bound"), or,
    with ``stop`` infinite and ``whole``, also every pipeline `_whole_round` may weigh
    ("whole": those within `REFINE_MARGIN` of the best and the fastest of equal stages). The
    DP on bounds finds no slower a pipeline than on the plans they bound, and one priced
    throughout is the one it finds with everything priced. ``found``: the DPs' pipelines
    already run on the profiler as it is (a search picked up where it stopped)."""
    while True:
        if found is None:
            found = candidates()
        uses = [profiler.deferred_in(c.stages) for c in found]
        k = min(range(len(found)), key=lambda j: found[j].total_latency)
        best, need = found[k], set(uses[k])
        if need and best.total_latency >= stop:
            return found, "bound"
        if not need and (stop < math.inf or not whole):
            return found, "best"
        if whole and stop == math.inf:
            # Those within the margin of the best's bound are priced with it, in one round.
            top = best.total_latency
            even = min((c.total_latency for c, used in zip(found, uses)
                        if not used and _even(c)), default=math.inf)
            for c, used in zip(found, uses):
                if c.total_latency <= (1 + REFINE_MARGIN) * top or \
                        (_even(c) and c.total_latency <= even):
                    need |= used
            if not need:
                return found, "whole"
        # Every deferred variant of the submeshes named: a DP run costs about what a logical
        # mesh's variants do (GPT-39B on 64 V100: 1.2 s a run; one round a variant took 15
        # runs where one a submesh takes 7), and pipelines that use one use their
        # neighbours.
        profiler.reveal(set().union(*(profiler.deferred_on(sub) for sub, _, _ in need)))
        found = None


def _with_hosts(problem: PipelineProblem, hosts: tuple[int, ...]) -> PipelineSolution:
    """The stage DP's pipeline, its typed stages laid on ``hosts`` in order."""
    return replace(solve_stage_dp(problem), hosts=hosts)


@dataclass(frozen=True)
class _WholeRound:
    """The pipelines of one count to solve whole (`_solved_whole`): the candidates within
    `REFINE_MARGIN` of the best estimate and the most micro-batches each stage keeps in
    flight."""

    near: tuple[PipelineSolution, ...]
    most: tuple[tuple[int, ...], ...]


def _whole_round(profiler: StageProfiler, candidates: list[PipelineSolution],
                 req: PipelineRequest) -> _WholeRound:
    ranked = sorted({c.stages: c for c in candidates}.values(), key=lambda c: c.total_latency)
    near = [c for c in ranked if c.total_latency <= (1 + REFINE_MARGIN) * ranked[0].total_latency]
    near = near[:REFINE_MAX]
    # And the fastest pipeline of equal stages (Megatron's shape), wherever its estimate lies:
    # by parts its stages may be priced far from what they solve, since a stage's plan under
    # its in-flight memory can lie between the plans the parts offer (GPT-39B's grid: 16
    # stages of 3 layers on 4 devices, 95.9 s by parts, 77.6 solved whole).
    even = [c for c in ranked if _even(c)][:1]
    near += [c for c in even if c not in near]
    most = [tuple(_most_in_flight(profiler, c)) for c in near]
    return _WholeRound(tuple(near), tuple(most))


def _even(pipeline: PipelineSolution) -> bool:
    """Whether ``pipeline`` has several stages, all on one submesh shape, of as many layers
    each as can be (one more on some)."""
    sizes = [s.end - s.start for s in pipeline.stages]
    return len(sizes) > 1 and len({s.submesh for s in pipeline.stages}) == 1 \
        and max(sizes) - min(sizes) <= 1


def _solved_whole(profiler: StageProfiler, round_: _WholeRound, req: PipelineRequest
                  ) -> tuple[PipelineSolution, bool]:
    """Of the pipelines the DPs found, those within `REFINE_MARGIN` of the best estimate (at
    most `REFINE_MAX`, `_whole_round`) with their stages solved whole, the fastest that fits.
    The estimates price long stages by parts (`StageProfiler._telescoped`), which misjudges
    them by several per cent either way, often more than the candidates differ; solved whole,
    the stages' latencies are the ones the plan reports. The DP's best is kept even if it does
    not fit solved whole (`_refitted` then looks further; the plan reports its peak); the
    second value says whether the pipeline returned fits."""
    budget = req.budget if req.budget is not None else math.inf
    # What `_relabels` weighs, priced side by side.
    profiler.reveal(set().union(*(profiler.deferred_on(s.submesh) for c in round_.near
                                  for s in c.stages)))
    # Each stage's most promising option first, then the others side by side, each cut off
    # once it cannot beat the first where that fits (`StageProfiler.whole_cost_below`).
    offers = [(s, n, options) for c, m in zip(round_.near, round_.most)
              for s, n in zip(c.stages, m)
              for options in [_relabels(profiler, s, budget, n)] if options]
    profiler.prefetch_whole_costs([(s.start, s.end, s.submesh, options[0].label, n)
                                   for s, n, options in offers])
    others, bounds = [], []
    for s, n, options in offers:
        latency, memory = profiler.whole_cost(s.start, s.end, s.submesh, options[0].label, n)
        for o in options[1:]:
            others.append((s.start, s.end, s.submesh, o.label, n))
            bounds.append(latency if memory <= budget else math.inf)
    profiler.prefetch_whole_costs(others, bounds=bounds)
    chosen = [replace(c, stages=tuple(_stage_solved_whole(profiler, s, budget, n)
                                      for s, n in zip(c.stages, m)))
              for c, m in zip(round_.near, round_.most)]
    # A stage relabelled may be priced at another count than its relabelling was (its own
    # label's most in flight): those solves too run side by side, not one by one.
    profiler.prefetch_whole_costs([r for c in chosen for r in _whole_requests(profiler, c)])
    best, best_fits = None, False
    for k, c in enumerate(chosen):
        whole, fits = solved_as_whole(profiler, c, budget, req.dp_schedule)
        if (fits or not k) and (best is None or whole.total_latency < best.total_latency):
            best, best_fits = whole, best_fits or fits
    assert best is not None
    return best, best_fits


def solved_as_whole(profiler: StageProfiler, pipeline: PipelineSolution, budget: float,
                    schedule: str) -> tuple[PipelineSolution, bool]:
    """``pipeline`` with each stage's latency from its whole solve and its T run on
    ``schedule`` (`to_plan.scheduled_step`, not eq. 2: the runtime's sends overlap), and
    whether every stage fits ``budget`` so. `StageProfiler.solutions` solves the stages of one
    structure and plan once, at the most micro-batches any of them keeps: priced so here
    (memory conservatively at that count), the figures are the plan's."""
    solved = [profiler.whole_cost(*r) for r in _whole_requests(profiler, pipeline)]
    cl = profiler.cluster
    cuts = inbound_discounts(profiler, pipeline,
                             stage_devices(pipeline, cl.num_hosts, cl.devices_per_host),
                             cl.devices_per_host)
    stages = tuple(replace(s, option=replace(s.option, latency=latency - cut))
                   for s, (latency, _), cut in zip(pipeline.stages, solved, cuts))
    by_eq2 = make_solution(stages, profiler.microbatches, pipeline.stats, pipeline.chunks,
                           pipeline.hosts)
    step = scheduled_step(profiler, stages, [s.option.latency for s in stages], cuts, schedule,
                          pipeline.chunks)
    return (replace(by_eq2, total_latency=step),
            fits_by_mesh([memory for _, memory in solved], pipeline.chunks, budget))


def _whole_requests(profiler: StageProfiler, pipeline: PipelineSolution
                    ) -> list[tuple[int, int, Submesh, StageLabel, int]]:
    """Per stage, the whole solve `solved_as_whole` prices it by: ``(start, end, submesh,
    label, in_flight)`` at the most micro-batches any stage of its structure, submesh and
    label keeps."""
    most: dict[tuple, int] = {}
    for s in pipeline.stages:
        group = (profiler.key(s.start, s.end), s.submesh, s.option.label)
        most[group] = max(most.get(group, 0), s.in_flight)
    return [(s.start, s.end, s.submesh, s.option.label,
             most[(profiler.key(s.start, s.end), s.submesh, s.option.label)])
            for s in pipeline.stages]


def fits_by_mesh(memory: list[float], chunks: int, budget: float) -> bool:
    """Whether every mesh fits ``budget`` given each stage's ``memory`` (its state and its
    activations at its own in-flight peak): a mesh's is the sum over its ``chunks`` stages,
    an upper bound under interleaving (its stages' peaks need not coincide)."""
    return all(m <= budget for m in mesh_memory(memory, chunks))


def mesh_memory(memory: list[float], chunks: int) -> list[float]:
    """Each mesh's memory: the sum of its ``chunks`` stages' (stage k on mesh k % meshes)."""
    meshes = len(memory) // chunks
    return [math.fsum(memory[i::meshes]) for i in range(meshes)]


def _most_in_flight(profiler: StageProfiler, pipeline: PipelineSolution) -> list[int]:
    """Per stage, the most micro-batches any stage of its structure and submesh keeps: the
    count `solved_as_whole` prices such stages at (a plan fitting it fits them all), so their
    plans are chosen at it too, one whole solve per structure instead of one per stage."""
    most: dict[tuple, int] = {}
    for s in pipeline.stages:
        group = (profiler.key(s.start, s.end), s.submesh)
        most[group] = max(most.get(group, 0), s.in_flight)
    return [most[(profiler.key(s.start, s.end), s.submesh)] for s in pipeline.stages]


def _stage_solved_whole(profiler: StageProfiler, stage: StagePlacement, budget: float,
                        in_flight: int) -> StagePlacement:
    """``stage`` with the logical mesh and recomputation whose whole solve with ``in_flight``
    micro-batches kept is fastest within the budget, of those `_relabels` offers."""
    best, best_latency = stage, math.inf
    for o in _relabels(profiler, stage, budget, in_flight):
        cost = profiler.whole_cost_below(stage.start, stage.end, stage.submesh, o.label,
                                         in_flight, best_latency)
        if cost is not None and cost[1] <= budget and cost[0] < best_latency:
            best, best_latency = replace(stage, option=o), cost[0]
    return best


def _relabels(profiler: StageProfiler, stage: StagePlacement, budget: float, in_flight: int
              ) -> list[StageOption]:
    """Per logical mesh and recomputation, the fastest option of ``stage``'s layers and
    submesh, for those within `REFINE_MARGIN` of the chosen option's estimate whose leanest
    plan fits by parts (a whole solve is the unconstrained ILP under the pipeline's memory,
    whatever variant priced the option, so one per kind)."""
    options = profiler(stage.start, stage.end, stage.submesh)
    limit = (1 + REFINE_MARGIN) * stage.option.latency
    kinds: dict[tuple, StageOption] = {}
    leanest: dict[tuple, float] = {}
    for o in options:
        kind = (o.label.logical_shape, o.label.kind)
        leanest[kind] = min(leanest.get(kind, math.inf), o.memory_bytes(in_flight))
        if o.latency <= limit and (kind not in kinds or o.latency < kinds[kind].latency):
            kinds[kind] = o
    # Kinds whose leanest plan is well over the budget by parts will not fit solved whole.
    return sorted((o for k, o in kinds.items()
                   if o is stage.option or leanest[k] <= (1 + REFINE_MARGIN) * budget),
                  key=lambda o: o.latency)


def _one_stage_if_faster(profiler: StageProfiler, best: PipelineSolution,
                         req: PipelineRequest) -> PipelineSolution:
    """The whole model as one stage on every device, solved whole under the memory limit,
    when that beats the DP's pipeline. By parts, a long stage is priced at its fastest plan
    ("free") or its leanest ("lean"); when the first does not fit and the second does, the
    fastest plan that fits lies between and only a whole solve finds it (Megatron's tensor
    parallelism within 1.07x of the smallest memory, say, where the leanest plan is ZeRO-3
    with its gathers). One stage is the one pipeline that cannot gain from splitting, and the
    plan an intra-only user would get, so it is checked exactly."""
    cl, last = req.cluster, profiler.layering.num_layers
    full = (cl.num_hosts, cl.devices_per_host)
    options = profiler.estimates(0, last, full)
    fits = {o.label: o.memory_bytes(1) <= (req.budget or float("inf")) for o in options}
    free = {o.label: o.latency for o in options if o.label.budget == "free"}
    # Lean plans are priced only on the logical meshes where the free plan could win.
    profiler.reveal((full, label.logical_shape, "lean") for label, latency in free.items()
                    if not fits[label] and latency * profiler.microbatches < best.total_latency)
    options = profiler.estimates(0, last, full)
    fits = {o.label: o.memory_bytes(1) <= (req.budget or float("inf")) for o in options}
    # Only where even the fastest plan (free, ignoring memory) could beat the pipeline.
    gaps = [o for o in options if o.label.budget == "lean" and not o.label.recompute
            and fits[o.label] and not fits.get(replace(o.label, budget="free"), False)
            and free.get(replace(o.label, budget="free"), 0.0) * profiler.microbatches
            < best.total_latency]
    for o in gaps:
        solved = profiler.solutions([(0, last, full, o.label, 1)])[0]
        if solved.memory_bytes > (req.budget or float("inf")):
            continue
        option = replace(o, latency=solved.latency)
        one = make_solution((StagePlacement(0, last, full, option, 1),),
                            profiler.microbatches, best.stats)
        if one.total_latency < best.total_latency:
            best = one
    return best


def _stage_counts(num_layers: int, shape: ClusterShape, uneven: bool = False) -> list[int]:
    """Stage counts S for equal stages: N/S devices form one of the submesh shapes, and S
    divides the layers (Alpa's equal-layer ablation) or, ``uneven``, is at most L."""
    sizes = {h * d for h, d in submesh_shapes(shape)}
    return [n for n in range(1, num_layers + 1) if (uneven or num_layers % n == 0)
            and shape.num_devices % n == 0 and shape.num_devices // n in sizes]


def layer_splits(num_layers: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """The ways to cut L layers into S stages as evenly as they go: L/S each, or where S
    does not divide L, one layer more in each of the last (or the first) L mod S stages. The
    clustering gives a model's head or embedding a layer of its own when it is too heavy to
    share one with a block (`clustering.default_num_layers`): 32 blocks and a head make 33
    layers, and 8 stages of 4 blocks then need the head's layer added to one end."""
    per, extra = divmod(num_layers, num_stages)
    ends = ("last", "first") if extra else ("last",)
    out = []
    for end in ends:
        sizes = [per + (1 if (i >= num_stages - extra if end == "last" else i < extra) else 0)
                 for i in range(num_stages)]
        starts = [sum(sizes[:i]) for i in range(num_stages)]
        out.append([(a, a + n) for a, n in zip(starts, sizes)])
    return out


def equal_stages(profile: Profile, num_stages: int, per: int, submesh: Submesh, b: int,
                 req: PipelineRequest, keep: Callable[[StageOption], bool] = lambda o: True
                 ) -> tuple[tuple[StagePlacement, ...] | None, float]:
    """``num_stages`` stages of ``per`` layers each on ``submesh`` (`stages_on`)."""
    return stages_on(profile, [(i * per, (i + 1) * per) for i in range(num_stages)], submesh,
                     b, req, keep)


def stages_on(profile: Profile, bounds: list[tuple[int, int]], submesh: Submesh, b: int,
              req: PipelineRequest, keep: Callable[[StageOption], bool] = lambda o: True
              ) -> tuple[tuple[StagePlacement, ...] | None, float]:
    """Stages of the layer ranges ``bounds``, each on ``submesh`` with its fastest option (of
    those ``keep`` allows) that fits with its in-flight micro-batches: with the stages fixed
    this minimizes eq. 2's sum and max at once, no DP needed. Returns the stages (None when
    one has no fitting option) and the memory the leanest options need."""
    stages, need = [], 0.0
    for i, (start, end) in enumerate(bounds):
        in_flight = SCHEDULES[req.dp_schedule](i, len(bounds), b)
        options = [o for o in profile(start, end, submesh) if keep(o)]
        need = max(need, min((o.memory_bytes(in_flight) for o in options), default=math.inf))
        fitting = [o for o in options
                   if req.budget is None or o.memory_bytes(in_flight) <= req.budget]
        if fitting:
            stages.append(StagePlacement(start, end, submesh,
                                         min(fitting, key=lambda o: o.latency), in_flight))
    return (tuple(stages) if len(stages) == len(bounds) else None), need


def _equal_stages(profile: Profile, num_layers: int, num_stages: int, shape: ClusterShape,
                  b: int, req: PipelineRequest, links: Links | None = None) -> PipelineSolution:
    """The best pipeline of S stages of L/S layers on N/S devices each (Alpa's "equal layer"
    ablation: no DP over uneven stages; each stage's intra plan still searched), over the
    submeshes of N/S devices (`stages_on`), and where S does not divide L over the two most
    even splits (`layer_splits`). Raises NoPipelineError when none fits."""
    t0 = time.perf_counter()
    devices = shape.num_devices // num_stages
    best, need = None, math.inf
    for submesh in (s for s in submesh_shapes(shape) if s[0] * s[1] == devices):
        for bounds in layer_splits(num_layers, num_stages):
            stages, needs = stages_on(profile, bounds, submesh, b, req)
            need = min(need, needs)
            if stages is None:
                continue
            sol = make_solution(linked(stages, links, shape.devices_per_host), b,
                                DpStats(0, num_stages, time.perf_counter() - t0))
            if best is None or sol.total_latency < best.total_latency:
                best = sol
    if best is None:
        raise NoPipelineError(f"{num_stages} equal stages do not fit", req.budget, need)
    return best
