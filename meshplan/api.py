"""Python front door: ``meshplan.plan(model, loss_fn, optimizer, example_batch, cluster)``.

The whole intra-operator pipeline, one named pass per line: capture -> choices -> ILP -> plan.
"""

from __future__ import annotations

import functools
import math
import warnings

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from torch import nn

from meshplan.capture.ahead import CapturesAhead
from meshplan.capture.batch import batch_size, split_microbatches
from meshplan.capture.memo import program_made_already, remember_program
from meshplan.capture.to_ir import capture
from meshplan.capture.trace import uncompiled
from meshplan.collector import cycle_collector_paused
from meshplan.cost.cluster import Cluster, cluster_to_dict, parse_cluster_spec
from meshplan.cost.memory import OptimizerState, unsharded_state_bytes
from meshplan.cost.mesh import GATHER_IMPLS, LogicalMesh, logical_mesh
from meshplan.cost.precision import resolve_dtype, with_compute_dtype
from meshplan.errors import (IlpCutOffError, InfeasibleIlpError, InfeasiblePlanError,
                             MicrobatchError, NodeLimitError, NoPipelineError)
from meshplan.forked import Forked, forks, value_or_in_place
from meshplan.plan.plan import Plan, StagePlan
from meshplan.planner.inter.device_kinds import host_types
from meshplan.planner.inter.price_sharing import shared_prices
from meshplan.planner.inter.manual import plan_megatron, plan_megatron_grid
from meshplan.planner.inter.megatron_spec import (SPEC_FORM, is_megatron_spec,
                                                  parse_megatron_spec)
from meshplan.planner.inter.search import PipelineRequest, resolve_schedule, search_pipeline
from meshplan.planner.hetero.alternate import (StepSettings, flat_choices, hetero_context,
                                               speed_shares)
from meshplan.planner.hetero.to_plan import (HETERO_METHODS, check_mixed_request,
                                             check_segments, plan_mixed)
from meshplan.planner.intra import baselines
from meshplan.planner.memory_floor import CountFloors
from meshplan.planner.recompute import FULL, NoReplayError, Replay, parse_recompute
from meshplan.planner.intra.choices import SFB_CHOICES, IntraOptions, resolve_choices
from meshplan.planner.intra.to_plan import intra_plan
from meshplan.planner.intra.formulate import (CostContext, doubling_runs, formulate,
                                             without_zero3)
from meshplan.planner.intra.ilp import (PLAN_ACCEPT, PLAN_REL_GAP, min_memory,
                                        peak_memory, plan_solve, solve, tied_leaves)
from meshplan.planner.intra.ilp_problem import IlpProblem, IlpSolution
from meshplan.runtime.optim import optimizer_spec

METHODS = ("auto", "intra-only", "inter-only", "equal-layer", "equal-operator", "data",
           "zero2", "zero3", "megatron", "megatron-grid", "heuristic", "expert", *HETERO_METHODS)
PIPELINE_METHODS = ("auto", "inter-only", "equal-layer", "equal-operator", "megatron-grid")


def check_method(method: str) -> str:
    """``method`` if it is one of `METHODS` or a Megatron configuration ``megatron:dp=..``
    (checked by `parse_megatron_spec`); else ValueError naming the valid methods."""
    if is_megatron_spec(method):
        parse_megatron_spec(method)
    elif method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}, "
                         f"{SPEC_FORM}")
    return method


def is_pipeline_method(method: str) -> bool:
    """Whether ``method`` plans pipeline stages on submeshes of the cluster."""
    return method in PIPELINE_METHODS or is_megatron_spec(method)


def _is_megatron(method: str) -> bool:
    """Megatron-LM's pipelines: one configuration, or the grid of them."""
    return method == "megatron-grid" or is_megatron_spec(method)


def method_options(method: str, *, force_batch_dim: int | None = None,
                   prefer_reduce_scatter: bool = False) -> dict[str, Any]:
    """IntraOptions fields of a planning method (``auto`` is the unconstrained ILP). Megatron
    pipelines ("megatron:dp=..", "megatron-grid") plan each stage as method "megatron"."""
    check_method(method)
    if _is_megatron(method):
        method = "megatron"
    opts: dict[str, Any] = {"force_batch_axis": force_batch_dim,
                            "prefer_reduce_scatter": prefer_reduce_scatter}
    if method not in ("auto", "intra-only", "equal-layer", "equal-operator", "hetero"):
        opts["full_split"] = True
    if method in ("data", "zero2", "zero3", "inter-only", "dp-even", "dp-proportional"):
        opts["force_data_parallel"] = True
        if method in ("zero2", "zero3"):
            opts["update_mode"] = method
    elif method == "megatron":
        opts.update(force_batch_axis=0, tensor_axis=1)
    elif method == "expert":
        opts["prefer_reduce_scatter"] = True  # ZeRO-2 for the replicated parameters
    if method == "heuristic":
        opts["full_split"] = None  # like auto: replicated work only when compute is costed
    return opts


def _cluster(cluster: Cluster | str) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return parse_cluster_spec(cluster)
    raise TypeError(f"cluster must be a meshplan Cluster or a spec string such as 'local:4', "
                    f"got {type(cluster).__name__}")


def _budget(memory_budget_gb: float | None, cluster: Cluster) -> float | None:
    if memory_budget_gb is None:
        return float(cluster.device.memory_bytes)
    if memory_budget_gb < 0:
        raise ValueError(f"memory budget must be >= 0 GB (0 = no budget), got {memory_budget_gb}")
    return None if memory_budget_gb == 0 else memory_budget_gb * 2**30


def _refine(problem: IlpProblem, shared: IlpSolution) -> IlpSolution:
    """Shared blocks give a fast answer; the problem with each block's repeats tied only in runs
    of 1, 2, 4, ... (`doubling_runs`), searched from that answer at HiGHS's root
    (`REFINE_MAX_NODES`), may be better: under a binding budget some blocks take a leaner plan
    and the rest a faster one (GPT-39B on 64 V100s, one stage: 10 % faster). Keep the better, so
    sharing never costs plan quality. A node count, not a time limit: the same inputs give the
    same plan on any machine. Interchangeable leaves are untied here too
    (`IlpProblem.tie_leaves`): under a binding budget, identical experts may fit a faster plan
    by mixing (OLMoE's 64 experts on one DGX A100: 889.8 ms tied, 886.8 untied, at 79.99 of 80
    GiB)."""
    if not problem.aliases and not tied_leaves(problem):
        return shared
    free = solve(replace(problem, aliases=doubling_runs(problem.aliases), tie_leaves=False),
                 max_nodes=REFINE_MAX_NODES, start=shared.choices, rel_gap=PLAN_REL_GAP)
    if free.objective < shared.objective:
        return replace(free, solve_time_s=free.solve_time_s + shared.solve_time_s)
    return replace(shared, solve_time_s=free.solve_time_s + shared.solve_time_s)


# `_refine`'s search: its root only. Started from the shared answer, HiGHS's root heuristics
# find the unshared improvement at once: MoE-10B on 16 V100 (40,853 columns), 156.6475 ->
# 156.6300 at the root in 4.9 s, where the unstarted search had 156.6297 after its 194 s time
# limit (10x the shared solve); 1000 nodes (34 s) found nothing better. Each repeat untied, the
# root is what costs on the largest: GPT-39B on 64 V100 (128 micro-batches, 84,252 columns)
# 4460.1 -> 4013.7 in 232 s of root cuts; in doubling runs (21,924 columns) 4013.2 at the root
# in 9 s. The nodes after it rarely add: the 36 refinements of six intra-only walks of the
# weak-scaling suite (GPT-6.7B to 39B, MoE-10B to 70B, Wide-ResNet-13B) took 369 s at 50
# nodes and 226 s at the root, 31 of them the same and five 0.02-1.3 % dearer (10 nodes lost
# the same five). The suite's 21 intra-only plans: 19 the same, GPT-39B's 0.155 % and
# MoE-690M's 0.001 % dearer, within what `PLAN_ACCEPT` accepts of any solve; their
# searches 1,024 -> 859 s (session 63).
REFINE_MAX_NODES = 1


def _infeasible(form: Any, budget: float, cluster: Cluster, method: str) -> InfeasiblePlanError:
    """The smallest per-device memory any plan needs, and what would make one fit: the
    parameters' share (their state, fully sharded, cannot shrink further on this mesh) against
    the activations' (proportional to the batch)."""
    need = min_memory(form.problem)
    mem, roots, graph = form.problem.node_memory, form.roots, form.choices.graph
    state = sum(min(mem[i]) for i, r in enumerate(roots) if graph.by_name[r].role == "param")
    rest = max(need - state, 0.0)
    gib = 2**30
    tips = [f"Of the smallest plan, at least {state / gib:.3f} GiB per device is parameters, "
            f"gradients and optimizer state and about {rest / gib:.3f} GiB activations."]
    if state > budget:
        devices = form.ctx.mesh.shape[0] * form.ctx.mesh.shape[1]
        # Sharded over every device the state shrinks with their number: "1.0x more" read
        # as twice as many where 5 of 4 would do.
        tips.append(f"The state alone exceeds the budget: use at least "
                    f"{math.ceil(devices * state / budget)} devices (about "
                    f"{state / budget:.1f}x the {devices} of this mesh).")
    elif rest > 0:
        tips.append(f"A micro-batch about {rest / max(budget - state, 1.0):.1f}x smaller "
                    f"(more micro-batches than {form.ctx.microbatches}, or a smaller global "
                    "batch) would fit.")
    if method != "auto":
        tips.append("Method 'auto' may find a plan that uses less memory (ZeRO-3, tensor "
                    "parallelism).")
    return InfeasiblePlanError(budget, need, " ".join(tips))


def _plan(model: nn.Module, loss_fn: Callable | None, optimizer: Any, example_batch: Any,
          cluster: Cluster | str, *, mesh_shape: Sequence[int] | None = None,
         alpha: Sequence[float] | None = None, beta: Sequence[float] | None = None,
         method: str = "auto", force_batch_dim: int | None = None,
         prefer_reduce_scatter: bool = False, memory_budget_gb: float | None = None,
         axis_weights: Sequence[Sequence[float]] | None = None, share_blocks: bool = True,
         dtype: str = "auto", microbatches: int | str = "auto", recompute: str = "auto",
         num_layers: int | None = None, schedule: str = "auto", name: str = "model",
         progress: bool = False, gather: str = "auto", sfb: str | None = None,
         segments: int = 1, segment_ratios: Sequence[Sequence[float]] | None = None,
         hold_half_copies: bool = True) -> Plan:
    """Find the optimal intra-operator plan of one training step on ``cluster``.

    ``example_batch`` is ``(inputs, target)`` (inputs a tensor, a tuple of tensors or a dict of
    keyword arguments; target a tensor or None) or a dict of keyword arguments alone; every
    tensor's dim 0 is the batch. The loss is ``loss_fn(output, target)``, ``loss_fn(output)``
    without target, or the model's own (``output.loss``, ``output["loss"]``) when ``loss_fn``
    is None, as for a ``transformers`` model given ``labels=``.

    ``optimizer`` is a torch optimizer (SGD, Adam, AdamW) or its name. ``alpha``/``beta`` (per
    mesh axis) switch the objective to those abstract units with compute left out, as in Alpa;
    otherwise it is seconds on the cluster. ``memory_budget_gb`` defaults to the device memory;
    0 means no budget. ``axis_weights`` gives uneven shard weights per mesh axis (HAP-style
    ratios, priced as uneven; method "hetero" takes them as fixed per-device ratios). ``share_blocks``: repeated layers share ILP decisions (faster;
    the optimum of the unshared problem may be slightly lower).

    The training step: ``dtype`` "fp32", "bf16", "fp16" or "auto" (bf16 where the device runs
    it faster, else fp16 where that is faster, else fp32); ``microbatches`` a count dividing
    the batch, or "auto" for the fewest that fit the budget as simulated, and more while the
    budget costs the plan time and each count is faster (where it does not bind, more only
    add per-micro-batch latency on one stage); ``recompute`` "none", "full" (the forward
    again during backward, each clustered layer checkpointed on its own: Megatron-LM's full
    recomputation), "selective" (only the attention cores: Megatron-LM's selective
    recomputation),
    "layers:K" (the first K layers of each stage) or "auto" (only where memory demands it:
    per pipeline stage the fastest of these that fits; none on one given mesh);
    ``schedule`` of a pipeline "auto" (1F1B, or interleaved 1F1B when the planner finds it
    faster), "1f1b", "gpipe" (every micro-batch in flight) or "interleaved" (Megatron-LM's
    virtual stages: each stage mesh runs v model chunks, the chunk count the fastest that
    fits; needs the micro-batches a multiple of the stages).
    ``progress``: progress bars on stderr during long pipeline searches (only when stderr is a
    terminal).

    Clusters of mixed devices (HAP, `planner/hetero/`): method "hetero" plans one SPMD
    program over all devices as a (1, n) mesh with per-device shard ratios, alternating
    program synthesis (an A* search) and the ratio LP; "auto" on a mixed cluster without a
    ``mesh_shape`` returns the faster of that and the uniform search's plan (every device
    priced as the slowest; ``options["mixed_auto"]`` records both steps); "dp-even" and "dp-proportional" are data parallelism with an even batch
    split or one proportional to the devices' speeds. ``gather`` says how uneven shards are
    gathered: "padded" all-gathers, "broadcast" (one broadcast per device) or "auto" (the
    cheaper per tensor). ``sfb``: sufficient-factor broadcasting of matmul weight gradients
    (`planner/intra/sfb.py`) — "auto" weighs it per weight, "force" uses it wherever it
    applies, "off" never; default "auto" for method "hetero" (and "auto" on a mixed cluster),
    "off" otherwise (Alpa's search space). It applies to single-stage plans. ``segments`` > 1
    (method "hetero", HAP §5.2) cuts the program into that many model segments of about equal
    FLOPs and balances a ratio set per segment, values re-cut by an all-to-all between them —
    kept when it predicts a faster step than one set (``options["hetero"]["segments"]`` says
    both); ``segment_ratios`` (one list of per-device ratios per segment) fixes them.

    Method "auto" without a ``mesh_shape`` (and in seconds, not abstract units) searches both
    levels (`planner/inter/search.py`): pipeline stages on submeshes over ``num_layers``
    clustered layers (default: chosen from the program and the cluster), each stage's
    intra-operator plan, and the micro-batch count; it may return a plan of several stages,
    which `PipelineTrainer` runs. On one host, or where that search answers one stage, it also
    weighs "intra-only"'s plan (one stage, its micro-batches walked as above) and returns
    the faster of those that fit as simulated (``options["single_stage_check"]`` records both
    steps and the choice). "intra-only", or "auto" with a ``mesh_shape``, plans one stage over
    the whole mesh. Alpa's ablations search pipelines too: "inter-only" (stages data
    parallel only), "equal-layer" (S equal stages on N/S devices each), "equal-operator" (layers
    of equal op counts instead of operator clustering).

    Megatron-LM's 3-D parallelism (`planner/inter/manual.py`): ``"megatron:dp=D,tp=T,pp=P"``
    with optional ``mb=M`` (micro-batch size per replica, so B = batch / (D·M); searched
    without it; then ``microbatches`` must be "auto") and ``virtual=V`` (interleaved 1F1B: P·V
    equal chunks, chunk k on stage k % P) plans P equal stages of D·T devices, each data parallel over D and
    tensor parallel over T; D·T·P must be the cluster's device count. "megatron-grid" returns
    the fastest such configuration that fits (tp a power of two within a host, micro-batch
    sizes 1-8). The plan's ``options["megatron"]`` records dp, tp, pp, mb and virtual. "megatron" alone
    is one stage on the whole mesh, data parallel on axis 0 and tensor parallel on axis 1.
    Pipeline methods other than "auto" refuse a ``mesh_shape`` and ``alpha``/``beta``.

    Raises ValueError on bad input, InfeasiblePlanError when no single-stage plan fits the
    budget (or no Megatron configuration does) and NoPipelineError when no pipeline does.
    """
    t0 = time.perf_counter()
    if gather not in GATHER_IMPLS:
        raise ValueError(f"gather must be one of {', '.join(GATHER_IMPLS)}, got {gather!r}")
    cl = _cluster(cluster)
    real_mesh = logical_mesh(cl, tuple(mesh_shape) if mesh_shape else None)
    abstract = alpha is not None or beta is not None
    if abstract and (alpha is None or beta is None):
        raise ValueError("give both alpha and beta (one value per mesh axis), or neither")
    mesh = LogicalMesh(real_mesh.shape, tuple(alpha), tuple(beta)) if abstract else real_mesh
    if axis_weights and method not in HETERO_METHODS:
        # A user's uneven split of a homogeneous mesh, priced as uneven.
        real_mesh = replace(real_mesh, weights=tuple(tuple(w) for w in axis_weights),
                            gather_impl=gather)
        mesh = replace(mesh, weights=real_mesh.weights, gather_impl=gather)
    opt = optimizer_spec(optimizer, {id(p): n for n, p in model.named_parameters()})
    budget = _budget(memory_budget_gb, cl)
    opts = IntraOptions(**method_options(method, force_batch_dim=force_batch_dim,
                                         prefer_reduce_scatter=prefer_reduce_scatter),
                        memory_budget=budget, include_compute=not abstract, optimizer=opt.kind,
                        share_blocks=share_blocks, hold_half_copies=hold_half_copies)
    mode, replay = parse_recompute(recompute)
    step = _TrainingStep(resolve_dtype(dtype, cl.device), mode == "full", replay=replay)
    schedule = resolve_schedule(schedule)
    counts = _microbatch_counts(microbatches, _batch_or_one(example_batch, microbatches))
    mixed_auto = method == "auto" and cl.is_mixed and mesh_shape is None and not abstract
    pipelines = is_pipeline_method(method) and mesh_shape is None and not abstract \
        and (cl.num_devices > 1 or _is_megatron(method)) and not mixed_auto
    opts = replace(opts, sfb=_sfb_choice(sfb, "hetero" if mixed_auto else method, pipelines))
    cut = check_segments(segments, segment_ratios, method, mixed_auto, cl.num_devices,
                         axis_weights)
    if method in HETERO_METHODS or mixed_auto:
        if step.recompute and not replay.whole:
            raise ValueError(f"recompute={recompute!r}: the heterogeneous methods recompute "
                             "every layer or nothing; give 'full', 'none' or 'auto'")
        fixed = check_mixed_request("hetero" if mixed_auto else method, mesh_shape, abstract,
                                    cl.num_devices, axis_weights)

        def uneven() -> Plan:
            return _plan_mixed(model, loss_fn, opt, example_batch, cl,
                               "hetero" if mixed_auto else method, opts, budget, step, counts,
                               name, gather, t0, fixed, cut)

        if not mixed_auto:
            return uneven()
        # The uneven program's search (HAP's A*, in this process alone: 6.3 of BERT-MoE's 65
        # s on HAP's cluster) runs in a child beside the two pipeline searches, on the cycles
        # their serial steps leave idle, below the trace made ahead they wait on
        # (`forked.py`); the same plan, or made here where the child cannot run.
        beside = Forked(uneven, "idle") if forks() else None
        try:
            # The uneven program is one row of all devices; the uniform search (pipelines,
            # 2-D meshes that keep tensor parallelism inside a host) prices every device as
            # the slowest, which even shares make exact. Either may win (HAP's VGG19: the
            # 2-D plan).
            uniform_cluster = cl.submesh(f"{cl.name} (as its slowest device)", cl.num_hosts,
                                         cl.devices_per_host)
            # The typed search's stages on the slowest type are the uniform search's
            # submeshes: it reads their prices (`planner/inter/price_sharing.py`).
            with shared_prices():
                try:
                    # The loss scaling of the plan returned is made once, by `plan`: not of
                    # this one unless it wins.
                    uniform: Plan | None = _plan_fitting(
                        model, loss_fn, optimizer, example_batch, uniform_cluster,
                        memory_budget_gb=memory_budget_gb, force_batch_dim=force_batch_dim,
                        prefer_reduce_scatter=prefer_reduce_scatter,
                        share_blocks=share_blocks, dtype=dtype, microbatches=microbatches,
                        recompute=recompute, num_layers=num_layers, schedule=schedule,
                        name=name, progress=progress)
                except (InfeasiblePlanError, NoPipelineError):
                    uniform = None
                if uniform is not None:   # on the mixed cluster, paced by its slowest type
                    uniform = replace(uniform, cluster=cluster_to_dict(cl))
                # Pipelines whose stages are each of one device type, where the hosts are
                # (`planner/inter/device_kinds.py`): slow devices get stages of their own.
                typed = None
                if host_types(cl) is not None:
                    # At the uniform plan's micro-batch count when there is one: typed
                    # stages move the balance between stages, not the count's trade-off
                    # (bubble against per-batch cost), and each count prices every stage on
                    # each device type.
                    typed_counts = [uniform.microbatches] if uniform is not None else counts
                    try:
                        typed = _plan_pipeline(model, loss_fn, opt, example_batch, cl,
                                               replace(opts, sfb="off"), budget, step,
                                               typed_counts, num_layers, name, recompute,
                                               "auto", schedule, microbatches, progress)
                    except (InfeasiblePlanError, NoPipelineError):
                        typed = None
        except BaseException:
            if beside is not None:
                beside.stop()
            raise
        found = value_or_in_place(beside, uneven)
        plans = {"hetero": found, "uniform": uniform, "typed stages": typed}
        steps = {k: p.predicted["step_time_s"] if p is not None else None
                 for k, p in plans.items()}
        chosen = min((k for k in plans if plans[k] is not None), key=lambda k: steps[k])
        best = plans[chosen]
        best.options["mixed_auto"] = {"chosen": chosen, "step_s": steps}
        return replace(best, search_time_s=time.perf_counter() - t0)
    if is_pipeline_method(method) and method != "auto" and (mesh_shape is not None or abstract):
        raise ValueError(f"method {method!r} searches pipeline stages on submeshes of the "
                         "cluster: give no mesh_shape and no alpha/beta")
    # Parameters, gradients and optimizer state sharded over every device already exceeding
    # the budget: no plan fits, whatever the stages or micro-batches; the single-stage search
    # explains it (once, at the most micro-batches).
    state_too_large = budget is not None and _state_floor(
        model, cl.num_devices, opt.state()) > budget
    piped: Plan | None = None
    if state_too_large:
        counts = counts[-1:]
    elif is_pipeline_method(method) and mesh_shape is None and not abstract \
            and (cl.num_devices > 1 or _is_megatron(method)):
        try:
            piped = _plan_pipeline(model, loss_fn, opt, example_batch, cl, opts, budget, step,
                                   counts, num_layers, name, recompute, method, schedule,
                                   microbatches, progress)
        except InfeasiblePlanError:
            if method != "auto":
                raise
            # explained below by the single-stage search, which knows what would help
        if piped is not None and not (method == "auto"
                                      and _weighs_intra_only(piped, cl)):
            return piped
    # Each plan as the simulator runs it, op by op: a single-stage ILP fits by its live sets,
    # and the transients beyond them can take it over the budget (GPT-2.6B on 8 V100: 16.37
    # GiB simulated at 15.98 planned), where the pipeline's stages fit with theirs.
    from meshplan.sim.simulate import simulate   # the simulator reads plans: not at import
    piped_over = piped is not None and budget is not None and \
        max(simulate(piped).peak_memory_bytes) > budget
    # "auto" on one given mesh recomputes nothing: its ILP holds a recomputed program's
    # memory per segment without the replay's gradients in flight, short of the op-by-op
    # peak, so a plan it found at the budget could predict above it. (The pipeline search
    # weighs recomputation per stage, a one-stage pipeline on every device included.)
    # The counts from the fewest micro-batches up: the first whose plan fits as simulated,
    # and on while the budget binds and each is faster than the last. A count whose plan the
    # ILP fits but whose transients still take it over goes on to the next (more micro-batches
    # hold less: MoE-70B on 64 V100s, one stage, 0.27 GiB over at 64); where the budget costs
    # a plan time, fewer activations per micro-batch can buy faster layouts than the extra
    # micro-batches cost (the same at 128 micro-batches: 289 s a step, not 632); where it
    # does not, more micro-batches only add latency. Where none fits, the plan least over.
    last: InfeasiblePlanError | None = None
    best: tuple[tuple, Plan] | None = None
    # Counts no plan could fit by the memory floor are skipped unsolved, all but the last
    # (the fewest samples a micro-batch), which explains when none fits (MoE-70B on 64
    # V100s: 1-16 micro-batches, 4.5 s each to formulate and find infeasible).
    floors = CountFloors(lambda b: _program(model, loss_fn, split_microbatches(
        example_batch, b)[0]), step.dtype, opt.state(), math.prod(real_mesh.shape), budget,
        recompute=step.recompute)
    skipped: list[int] = []

    def solved(num: int) -> tuple:
        return _plan_step(model, loss_fn, opt, example_batch, cl, mesh, real_mesh, method,
                          opts, budget, replace(step, microbatches=num))

    # The first count's plan, where it is over the budget as simulated, is fitted under it
    # (`_within_as_simulated`, 13-24 s a count on GPT-15B) only once the walk needs its step:
    # fitting only slows a plan, so its step before fitting bounds it, and where a later
    # count's fitted plan beats that it is never fitted (GPT-15B at 64 micro-batches: 2,833
    # s a step before fitting, 128's fitted 730). The later counts' own fits decide whether
    # the walk stops, so they are fitted at once. Every decision reads what it read with
    # every count fitted as it came (`_FitWhenNeeded`).
    walk = _FitWhenNeeded()
    for num in counts:
        if num != counts[-1] and not _may_fit(floors, num):
            skipped.append(num)
            continue
        try:
            found = solved(num)
        except InfeasiblePlanError as e:
            last = e
            continue
        except ValueError:
            if walk.any():
                break   # fewer samples per micro-batch than the model takes (batch norm of 1)
            if piped is not None:
                return piped
            # What explains it is the count nearest to fitting of those the floor skipped that
            # can be laid out (MoE-70B by method "expert" on 64 V100s: 1-16 micro-batches do
            # not fit, and 32 leave a micro-batch too few samples to lay out), solved for its
            # reasons.
            for below in reversed(skipped if last is None else []):
                last = _infeasible_or_none(lambda: solved(below))
                if last is not None:
                    break
            if last is None:
                raise
            raise last from None
        # The plans known to fit as simulated: the pipeline's, an earlier count's.
        piped_s = piped.predicted["step_time_s"] if piped is not None and not piped_over \
            else None
        beaten = functools.partial(walk.beaten, piped_s)
        one = _one_stage(found, name, method, opt, opts, budget, step, real_mesh, cl, gather,
                         axis_weights, abstract, beaten, t0)
        if one.fit is not None and walk.any():   # whether the walk stops reads its fit
            fitted, excess = one.fit()
            one = _OneStage(fitted, excess, one.walks_on)
        key = _walk_key(one.plan, one.excess)
        if walk.any() and one.excess <= 0 and walk.beats(key):
            break   # fits, but slower than the count before
        walk.add(one, key)
        if not one.walks_on:
            break
    best = walk.best()
    if best is None:
        if piped is not None:
            return piped
        assert last is not None
        raise last
    result = best[1]
    if piped is None:
        return result
    steps = {"pipeline": piped.predicted["step_time_s"],
             "one stage": result.predicted["step_time_s"]}
    plans = {"pipeline": piped, "one stage": result}
    over = ["pipeline"] * piped_over + ["one stage"] * best[0][0]
    name = min(plans, key=lambda k: (k in over, steps[k]))
    # The pipeline search's own weighing of one stage (`search._one_stage_if_simulated_faster`)
    # stays on record whichever plan is chosen.
    kept = {k: v for k, v in piped.options.items() if k == "pipeline_check"}
    return replace(plans[name], search_time_s=time.perf_counter() - t0,
                   options={**plans[name].options, **kept, "single_stage_check": {
                       "step_s": steps, "chosen": name, "over_budget_simulated": over}})


@dataclass(frozen=True)
class _OneStage:
    """A single-stage plan at one micro-batch count, as `_plan` weighs it: the bytes its
    simulated peak is over the budget by (0 or less: it fits), and whether the count walk goes
    on to the next count (it is fitted under the budget as simulated, or the budget costs it
    time: `_budget_binds`). ``fit``: where the plan is to be fitted, the fitting (returning
    the fitted plan and its excess), left to when the walk needs it (`_FitWhenNeeded`)."""

    plan: Plan
    excess: float
    walks_on: bool
    fit: Callable[[], tuple[Plan, float]] | None = None


def _walk_key(plan: Plan, excess: float) -> tuple[bool, float, float]:
    """How the single-stage walk ranks a count's plan: those that fit first, then the least
    over; by step time."""
    return (excess > 0, max(excess, 0.0), plan.predicted["step_time_s"])


class _FitWhenNeeded:
    """The single-stage walk's counts: their plans as weighed (`_walk_key`), and those still
    to be fitted under the budget as simulated, each fitted only when a decision of the walk
    needs it. Fitting only slows a plan (it adds a bound), so an unfitted plan's key, that of
    a plan that fits at its step, bounds its fitted key from below: the counts whose bounds
    are under what a decision compares with are fitted, smallest first, and then the
    decision reads what it would have read with every count fitted at once."""

    def __init__(self) -> None:
        self._known: list[tuple[tuple, int, Plan]] = []   # (key, order, plan)
        self._unfitted: list[tuple[tuple, int, _OneStage]] = []   # (bound, order, count)

    def any(self) -> bool:
        return bool(self._known or self._unfitted)

    def add(self, one: _OneStage, key: tuple) -> None:
        order = len(self._known) + len(self._unfitted)
        if one.fit is None:
            self._known.append((key, order, one.plan))
        else:
            self._unfitted.append(((False, 0.0, one.plan.predicted["step_time_s"]), order, one))

    def _fit_next(self, bound: tuple) -> bool:
        """Fit the count of the smallest bound where that bound is ``bound`` or under (a tie
        may rank either way); whether there was one."""
        if not self._unfitted:
            return False
        self._unfitted.sort(key=lambda e: e[:2])
        if self._unfitted[0][0] > bound:
            return False
        _, order, one = self._unfitted.pop(0)
        assert one.fit is not None
        plan, excess = one.fit()
        self._known.append((_walk_key(plan, excess), order, plan))
        return True

    def _top(self) -> tuple[tuple, int, Plan] | None:
        return min(self._known, key=lambda e: e[:2], default=None)

    def best(self) -> tuple[tuple, Plan] | None:
        """The best count's key and plan (the earlier of equal ones); None before any count."""
        while True:
            top = self._top()
            if not self._fit_next((True, math.inf, math.inf) if top is None else top[0]):
                return None if top is None else (top[0], top[2])

    def beats(self, key: tuple) -> bool:
        """Whether a count so far ranks no worse than ``key`` (a count after them all)."""
        while not any(k <= key for k, _, _ in self._known):
            if not self._fit_next(key):
                return False
        return True

    def beaten(self, piped_s: float | None, step_s: float) -> bool:
        """Whether a plan that fits as simulated, ``piped_s`` (the pipeline's step, None where
        it does not fit) or the best count's where it fits, is faster than a step of
        ``step_s`` by more than `FITTED_LOSES`."""
        def faster(s: float | None) -> bool:
            return s is not None and step_s > (1 + FITTED_LOSES) * s

        while True:
            top = self._top()
            if faster(piped_s) or (top is not None and not top[0][0]
                                   and faster(top[2].predicted["step_time_s"])):
                return True
            # A count still to fit can only be as fast as its bound.
            bound = min(self._unfitted, default=None)
            if bound is None or not faster(bound[0][2]) or not self._fit_next(bound[0]):
                return False


def _one_stage(found: tuple, name: str, method: str, opt: Any, opts: IntraOptions,
               budget: float | None, step: "_TrainingStep", real_mesh: LogicalMesh,
               cl: Cluster, gather: str, axis_weights: Sequence[Sequence[float]] | None,
               abstract: bool, beaten: Callable[[float], bool], t0: float) -> _OneStage:
    """The single-stage plan of `_plan_step`'s answer ``found``, to be fitted under the budget
    as simulated (`_within_as_simulated`, its ``fit``) unless ``beaten(step)``: a plan that
    fits as simulated (the pipeline's, or an earlier count's of the walk) is faster:
    fitted under a lower bound it would be no faster (BERT-Base's one stage on HAP's cluster:
    two more solves, 8 of 39 s, for a plan the pipeline beat anyway; GPT-15B's intra-only
    walk on 32 V100: 3707 s a step at 256 micro-batches before fitting, where 128 fitted at
    730, 10 s), and not walked on to more micro-batches either (the pipeline search priced
    one stage over every device at each of its counts; the walk stops at a slower count)."""
    form, sol, graph, fingerprint, ctx, segments, num_layers_run, used = found
    weights = tuple(tuple(float(x) for x in w) for w in axis_weights) if axis_weights else ()

    def as_plan(sol: IlpSolution) -> Plan:
        # Recomputed segment by segment, as the runtime replays it (`runtime/step_modes`).
        result = intra_plan(form, sol, real_mesh, cl, name=name, fingerprint=fingerprint,
                            method=method, optimizer=opt.to_dict(), options=opts,
                            budget=budget, search_time_s=time.perf_counter() - t0,
                            dtype=step.dtype, unsupported_ops=graph.unsupported_ops,
                            axis_weights=weights, layers=segments,
                            replay=used if ctx.recompute else None)
        result.options["gather_impl"] = gather
        if num_layers_run > 1:
            result = replace(result, num_layers=num_layers_run)
        return replace(result, stages=(_whole_mesh_stage(result, cl),))

    result = as_plan(sol)
    if budget is None or abstract:
        return _OneStage(result, 0.0, False)
    excess = _over(result, budget)
    if beaten(result.predicted["step_time_s"]):
        return _OneStage(result, excess, False)
    if excess > 0:
        return _OneStage(result, excess, True, functools.partial(
            _within_as_simulated, result, form.problem, sol, budget, as_plan, excess))
    return _OneStage(result, excess, _budget_binds(form.problem, sol))


def _budget_binds(problem: IlpProblem, sol: IlpSolution) -> bool:
    """Whether ``problem``'s memory budget is known to cost its solution ``sol`` time: a plan
    without it faster by more than `PLAN_ACCEPT`'s gap (within which both are solved) found
    in as many nodes as `PLAN_ACCEPT` probes. HiGHS prunes by that cutoff; a proof that none
    exists can take long where the root's bound is weak (Wide-ResNet-6.8B at 26 layers on 32
    V100s, one stage: 13 % at the root, 8.5 s to prove none, 2.5 s for 50 nodes), so a probe
    that ends undecided counts as not binding: the plan stays at the fewest micro-batches
    that fit, as without the question."""
    if problem.memory_budget is None:
        return False
    nodes, gap = PLAN_ACCEPT
    try:
        solve(replace(problem, memory_budget=None, live_sets=()), cutoff=(1 - gap) * sol.objective,
              rel_gap=gap, max_nodes=nodes, search_on=False)
    except (IlpCutOffError, NodeLimitError):
        return False
    return True


# Rounds of `_within_as_simulated`.
AS_SIMULATED_ROUNDS = 3
# A one-stage plan this much slower than a pipeline that fits is not fitted under the budget
# as simulated (`_plan`): its solves stop within `PLAN_ACCEPT`'s gap of their optimum (0.5 %),
# so a fitted plan could come out that much under an unfitted one, never 1 %.
FITTED_LOSES = 0.01


def _within_as_simulated(plan: Plan, problem: IlpProblem, sol: IlpSolution, budget: float,
                         as_plan: Callable[[IlpSolution], Plan],
                         excess: float | None = None) -> tuple[Plan, float]:
    """``plan`` (of ``sol``), or when its peak as the simulator walks the step op by op
    exceeds ``budget``, the problem solved again under its bound less the excess (a few
    rounds: another plan has other transients), the first that fits or else the one least
    over it, with the bytes it is over by (0 or less: it fits).
    The ILP's live sets hold the kept activations and every gradient at once and nothing in
    between; the forward's temporaries and the backward's gradients in flight take a plan at
    the budget over it (GPT-2.6B on 8 V100: 16.37 GiB simulated at 15.98 planned, 16 GiB
    devices), as whole pipeline stages' solves already count (`stage_costs`). ``excess``:
    ``plan``'s own, where known."""
    if excess is None:
        excess = _over(plan, budget)
    least = (excess, plan)
    for _ in range(AS_SIMULATED_ROUNDS):
        if excess <= 0:
            return plan, excess
        tight = replace(problem, memory_budget=peak_memory(problem, sol.choices) - excess)
        try:
            sol = _refine(tight, plan_solve(tight))
        except InfeasibleIlpError:
            break
        # Each round's plan has transients of its own, and may be over by more than the last
        # (MoE-70B on 64 V100s, one stage: 0.27 GiB over, then 1.76): the least over is kept.
        plan = as_plan(sol)
        excess = _over(plan, budget)
        least = min(least, (excess, plan), key=lambda e: e[0])
    return (plan, excess) if excess <= 0 else (least[1], least[0])


def _over(plan: Plan, budget: float) -> float:
    """The bytes a single-stage plan's simulated peak exceeds ``budget`` by (0 where its
    bound `_peak_bound` is within it: no walk can exceed it)."""
    from meshplan.sim.simulate import simulate   # the simulator reads plans: not at import
    if _peak_bound(plan) <= budget:
        return 0.0
    return max(simulate(plan).peak_memory_bytes) - budget


def _peak_bound(plan: Plan) -> float:
    """An upper bound of a single-stage plan's simulated peak from its figures: the state
    with its gradients and working set, one micro-batch's kept bytes and the largest pass
    beyond them (`sim.task_costs` reads the same figures; the simulator holds the gradients
    only after the first backward)."""
    p = plan.predicted
    kept = p.get("layered_kept_bytes", p["activation_bytes"])
    passing = max(p.get(k, 0.0) for k in ("forward_peak_bytes", "backward_peak_bytes",
                                           "backward_held_peak_bytes")) - kept
    return p["state_bytes"] + p.get("working_bytes", 0.0) + kept + max(passing, 0.0)


def recompute_layering(graph: Any, num_devices: int) -> Any:
    """The layers a recomputed single-stage plan checkpoints one by one: the program's
    repeated blocks, else the search's default count (`planner/inter/clustering.py`)."""
    from meshplan.planner.inter.clustering import (cluster_layers, default_num_layers,
                                                   repeat_count)
    n = repeat_count(graph)
    return cluster_layers(graph, n if n > 1 else default_num_layers(graph, num_devices))


@functools.wraps(_plan, assigned=("__doc__",))
def plan(model: nn.Module, loss_fn: Callable | None, optimizer: Any, example_batch: Any,
         cluster: Cluster | str, **kwargs: Any) -> Plan:
    with cycle_collector_paused():   # its full collections walk all planning holds
        return _plan_once(uncompiled(model), loss_fn, optimizer, example_batch, cluster,
                          **kwargs)


def _plan_once(model: nn.Module, loss_fn: Callable | None, optimizer: Any, example_batch: Any,
               cluster: Cluster | str, **kwargs: Any) -> Plan:
    return _microbatch_loss(_plan_fitting(model, loss_fn, optimizer, example_batch, cluster,
                                          **kwargs), model, loss_fn, example_batch)


def _plan_fitting(model: nn.Module, loss_fn: Callable | None, optimizer: Any,
                  example_batch: Any, cluster: Cluster | str, **kwargs: Any) -> Plan:
    """`_plan`'s plan, searched again without the half copies where they are what does not
    fit."""
    try:
        found = _plan(model, loss_fn, optimizer, example_batch, cluster, **kwargs)
    except InfeasiblePlanError as e:
        # Under mixed precision a step holds its weights' half copies (2 bytes per element,
        # `runtime/step_casts.py`), which may be what does not fit: without them every
        # micro-batch and replay casts again, slower but smaller. They are at most a fifth
        # of what the smallest plan needs (each comes with at least 8 bytes of value and
        # gradient): beyond that no plan without them fits either, and none is searched.
        if not kwargs.get("hold_half_copies", True) or resolve_dtype(
                kwargs.get("dtype", "auto"), _cluster(cluster).device) == "fp32" \
                or 0.8 * e.min_memory_bytes > e.budget_bytes:
            raise
        found = _plan(model, loss_fn, optimizer, example_batch, cluster,
                      **{**kwargs, "hold_half_copies": False})
    return found


def _microbatch_loss(found: Plan, model: nn.Module, loss_fn: Callable | None,
                     example_batch: Any) -> Plan:
    """A plan of several micro-batches with what makes its step the full batch's: the loss's
    reductions over the batch, each scaled per micro-batch (`lower/microbatch.py`), recorded
    in ``options["microbatch_loss"]``; a loss micro-batches cannot add up is named in a
    warning, with what runs instead."""
    if found.microbatches <= 1:
        return found
    from meshplan.lower.microbatch import StepScales
    traced, graph = capture(model, loss_fn, split_microbatches(example_batch,
                                                               found.microbatches)[0])
    scales = StepScales(traced.graph_module, graph,
                        lambda: _few_samples_program(model, loss_fn, example_batch))
    found.options["microbatch_loss"] = {
        "exact": scales.inexact is None,
        "reductions": [[r.node, r.kind] for r in scales.reductions],
        "why": scales.inexact}
    if scales.inexact is not None:
        warnings.warn(f"meshplan: {found.microbatches} micro-batches cannot make this loss's "
                      f"full-batch step exactly: {scales.inexact}. Their losses are averaged "
                      "(each micro-batch weighted equally), as plain gradient accumulation "
                      "does; plan with microbatches=1 for the exact step", stacklevel=4)
    return found


def _few_samples_program(model: nn.Module, loss_fn: Callable | None, example_batch: Any
                         ) -> Any:
    """The program of an even cut of ``example_batch`` of more than one sample: where one
    sample's program hides its batch (a size-1 dim folds away), such a cut's shows it as the
    whole batch's does. The fewest samples that the micro-batch-count search has traced
    already, here or ahead in a child (`memo.program_made_already`: GPT-3 175B on 1024 A100s
    searched 1 and 3 samples, and a trace of 2 more took 2.9 s), else two (or the fewest that
    cut evenly), not the whole batch (a Llama-70B on meta: 7 s)."""
    size = batch_size(example_batch)
    cuts = [d for d in range(2, size + 1) if size % d == 0] or [size]
    for samples in cuts:
        graph = program_made_already(model, loss_fn,
                                     split_microbatches(example_batch, size // samples)[0])
        if graph is not None:
            return graph
    return capture(model, loss_fn, split_microbatches(example_batch, size // cuts[0])[0])[1]


def _sfb_choice(sfb: str | None, method: str, pipelines: bool) -> str:
    """The SFB option of a request (`plan`'s docstring), or ValueError for one it cannot honour."""
    if sfb is None:
        return "auto" if method == "hetero" else "off"
    if sfb not in SFB_CHOICES:
        raise ValueError(f"sfb must be one of {', '.join(SFB_CHOICES)}, got {sfb!r}")
    if sfb != "off" and method in ("dp-even", "dp-proportional"):
        raise ValueError(f"method {method!r} is data parallelism as PyTorch DDP runs it "
                         "(gradients all-reduced): give no sfb, or use method 'hetero'")
    if sfb != "off" and pipelines:
        raise ValueError(f"sfb={sfb!r} applies to single-stage plans; method {method!r} "
                         "searches pipelines: give a mesh_shape, or method 'intra-only' or "
                         "'hetero'")
    return sfb


def _plan_mixed(model: nn.Module, loss_fn: Callable | None, opt: Any, example_batch: Any,
                cl: Cluster, method: str, opts: IntraOptions, budget: float | None,
                step: "_TrainingStep", counts: list[int], name: str, gather: str,
                t0: float, ratios: tuple[float, ...] | None,
                cut: tuple[int, tuple[tuple[float, ...], ...] | None] = (1, None)) -> Plan:
    """A plan of `HETERO_METHODS` at the fewest micro-batches that fit; ``cut``: its segment
    count and fixed ratio sets (`check_segments`)."""
    last: InfeasiblePlanError | None = None
    for num in counts:
        _, traced = capture(model, loss_fn, split_microbatches(example_batch, num)[0])
        graph = with_compute_dtype(traced, step.dtype)
        settings = StepSettings(opt.state(), num, step.recompute, gather)
        try:
            found = plan_mixed(graph, traced.fingerprint(), cl, method, opts, settings, budget,
                               dtype=step.dtype, name=name, optimizer=opt.to_dict(), t0=t0,
                               ratios=ratios, segments=cut[0], segment_ratios=cut[1])
            return replace(found, stages=(_whole_mesh_stage(found, cl),))
        except InfeasibleIlpError:
            if budget is None:
                raise
            ctx = hetero_context(cl, speed_shares(cl.types, step.dtype), settings)
            last = _infeasible(formulate(flat_choices(graph, cl, opts), ctx, budget), budget,
                               cl, method)
    assert last is not None
    raise last


def _whole_mesh_stage(p: Plan, cl: Cluster) -> StagePlan:
    """A single-stage plan described as one stage, in the format of a pipeline's stages."""
    return StagePlan(0, (0, 1), tuple(range(cl.num_devices)), (cl.num_hosts,
                     cl.devices_per_host), tuple(p.mesh_shape), p.recompute, 1,
                     p.predicted["step_time_s"] / p.microbatches,
                     p.predicted["peak_memory_bytes"])


def _plan_pipeline(model: nn.Module, loss_fn: Callable | None, opt: Any, example_batch: Any,
                   cl: Cluster, opts: IntraOptions, budget: float | None, step: "_TrainingStep",
                   counts: list[int], num_layers: int | None, name: str, recompute: str,
                   method: str, schedule: str, microbatches: int | str, progress: bool) -> Plan:
    # The count search asks for a count more than once, and traces the next ahead.
    graph_for = CapturesAhead(
        lambda num: _count_graph(model, loss_fn, example_batch, num),
        lambda num, graph: remember_program(model, loss_fn,
                                            split_microbatches(example_batch, num)[0], graph))
    try:
        req = PipelineRequest(cl, opts, opt.to_dict(), opt.state(), budget,
                              step.dtype, num_layers, name, method, recompute, schedule, progress)
        fixed = None if microbatches == "auto" else int(microbatches)
        if method == "megatron-grid":
            return plan_megatron_grid(graph_for, batch_size(example_batch), fixed, req)
        if is_megatron_spec(method):
            spec = parse_megatron_spec(method)
            if spec.mb is not None and fixed is not None:
                raise ValueError(f"{method} fixes the micro-batch size (mb={spec.mb}); give "
                                 f"microbatches='auto', not {fixed}")
            return plan_megatron(graph_for, batch_size(example_batch), spec, counts,
                                 replace(req, method=str(spec)))
        return search_pipeline(graph_for, counts, req)
    finally:
        graph_for.close()


def _count_graph(model: nn.Module, loss_fn: Callable | None, example_batch: Any, num: int
                 ) -> Any:
    """The traced program of one of ``num`` micro-batches; MicrobatchError where the model
    fails on it and ``num`` is more than one (the counts below may still run)."""
    micro = split_microbatches(example_batch, num)[0]
    try:
        return _program(model, loss_fn, micro)
    except (ValueError, RuntimeError) as e:
        if num == 1 or isinstance(e, MicrobatchError):
            raise
        raise MicrobatchError(num, batch_size(micro), e) from e


def _program(model: nn.Module, loss_fn: Callable | None, micro: Any) -> Any:
    """The program (`Graph`) of one micro-batch ``micro``: the one made already, where the
    count search traced it ahead in a child too (`memo.program_made_already`), else
    captured."""
    made = program_made_already(model, loss_fn, micro)
    return made if made is not None else capture(model, loss_fn, micro)[1]


def _infeasible_or_none(solve: Callable[[], Any]) -> InfeasiblePlanError | None:
    """The InfeasiblePlanError ``solve`` raises; None where it finds a plan or cannot lay the
    program out (another ValueError)."""
    try:
        solve()
    except ValueError as e:   # InfeasiblePlanError is one
        return e if isinstance(e, InfeasiblePlanError) else None
    return None


def _may_fit(floors: CountFloors, num: int) -> bool:
    """`CountFloors.may_fit`, True where the count cannot be traced (fewer samples than the
    model takes: `_plan_step` says so)."""
    try:
        return floors.may_fit(num)
    except ValueError:
        return True


def _weighs_intra_only(piped: Plan, cl: Cluster) -> bool:
    """Whether "auto" also weighs "intra-only"'s plan (one stage at the fewest micro-batches
    that fit) against the pipeline search's ``piped``. One stage has no bubble to amortize,
    so its best count is often the smallest, which the search's walk down from the most
    micro-batches does not reach (GPT-2.6B on 8 V100: 27.69 s at 64 micro-batches against
    the pipeline's 29.31 s at 512); under a tight budget, more micro-batches can fit a plan
    that communicates less, and the search's own one stage wins. On one host always; across
    hosts, where one stage's collectives run over the slow links (it lost every row of the
    weak-scaling suite by 4-100x), only when the search itself answered one stage (GPT-6.7B's
    hidden size, 4 layers, batch 64 on 16 V100: 0.706 s at 64 micro-batches, 0.624 s at
    one); the search leaves the counts below such an answer to this plan
    (`search._CountSearch`). Even at the same count the two differ: the search prices its one
    stage through its own options, by parts then whole (GPT-15B's widths, 2 layers, on 32
    V100s at one micro-batch, both on a (4, 8) mesh: 0.1449 s simulated, intra-only's
    0.1421)."""
    return cl.num_hosts == 1 or piped.num_stages == 1


def _state_floor(model: nn.Module, num_devices: int, state: OptimizerState) -> float:
    """Bytes per device of the parameters, gradients and optimizer state when every one of
    them is sharded over all devices: a lower bound of any plan's memory."""
    return unsharded_state_bytes((tuple(p.shape) for p in model.parameters()),
                                 state) / num_devices


@dataclass(frozen=True)
class _TrainingStep:
    dtype: str
    recompute: bool
    microbatches: int = 1
    replay: Replay = FULL


def _batch_or_one(example_batch: Any, microbatches: int | str) -> int:
    """The batch size, or 1 where it does not matter (one micro-batch, or "auto" on a batch
    whose tensors disagree on dim 0: it cannot be cut)."""
    if microbatches == 1:
        return 1
    try:
        return batch_size(example_batch)
    except ValueError:
        if microbatches == "auto":
            return 1
        raise


def _microbatch_counts(microbatches: int | str, batch: int) -> list[int]:
    """The micro-batch counts to try, in order: the given one, or for "auto" every power of two
    dividing the batch (then the batch itself), fewest first."""
    if microbatches == "auto":
        if batch < 2:  # nothing to cut (an empty batch dim too)
            return [1]
        counts = [1 << k for k in range(batch.bit_length()) if batch % (1 << k) == 0]
        return counts + ([batch] if counts[-1] != batch else [])
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1 \
            or batch % microbatches:
        raise ValueError(f"microbatches must be 'auto' or a count dividing the batch of {batch}, "
                         f"got {microbatches!r}; valid counts: "
                         f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
    return [microbatches]


def _plan_step(model: nn.Module, loss_fn: Callable | None, opt: Any, example_batch: Any,
               cl: Cluster, mesh: LogicalMesh, real_mesh: LogicalMesh, method: str,
               opts: IntraOptions, budget: float | None, step: _TrainingStep) -> tuple:
    """Capture one micro-batch, cost it at the step's dtype and solve the ILP."""
    micro = split_microbatches(example_batch, step.microbatches)[0]
    program = _program(model, loss_fn, micro)
    graph = with_compute_dtype(program, step.dtype)
    choices = resolve_choices(graph, tuple(mesh.shape), opts)
    abstract = mesh is not real_mesh
    # The heuristic may gather a parameter that an earlier use placed (a tied embedding).
    ctx = CostContext(mesh, None if abstract else cl.device, opt.state(),
                      param_reshard=method == "heuristic", microbatches=step.microbatches,
                      recompute=step.recompute, half_copies=opts.hold_half_copies)
    if method == "heuristic":
        choices = baselines.heuristic(choices, ctx)
    elif method == "expert":
        choices = baselines.expert(choices)
    # Recomputed, the program replays segment by segment (layer by layer): the budget holds
    # per segment.
    segments, num_layers = None, 1
    if step.recompute:
        layering = recompute_layering(graph, cl.num_devices) \
            if step.replay.scope == "layers" else None
        segments = step.replay.segments(graph, layering.layer_of if layering else {})
        num_layers = layering.num_layers if layering else 1
        if not segments:
            raise NoReplayError(
                "recompute='selective': this program has no attention core to recompute (a "
                "fused attention, sdpa, keeps no scores); give 'full' or 'layers:K'")
        if not step.replay.whole:
            if opts.update_mode == "zero3":
                raise NoReplayError(f"recompute: {step.replay.describe()} with ZeRO-3 is not "
                                    "supported yet; recompute every layer ('full') or use "
                                    "another update mode")
            ctx = replace(ctx, recomputed=frozenset(segments))
    form = formulate(choices, ctx, budget, share_blocks=opts.share_blocks, layers=segments)
    if step.recompute and not step.replay.whole:
        form = replace(form, problem=without_zero3(form, form.problem))
    try:
        sol = _refine(form.problem, plan_solve(form.problem))
    except InfeasibleIlpError as e:
        if budget is None:
            raise ValueError(f"method {method!r} leaves no valid plan on a {tuple(mesh.shape)} "
                             f"mesh ({e}); try method 'auto' or another mesh shape") from None
        raise _infeasible(form, budget, cl, method) from None
    return form, sol, graph, program.fingerprint(), ctx, segments, num_layers, step.replay
