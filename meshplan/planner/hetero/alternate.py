"""HAP's alternating optimization (§3.1): synthesize the program for the current shard ratios,
balance the ratios for that program, and repeat until the pair stops improving.

The program is one SPMD program over every device of the cluster as a 1-D mesh ``(1, n)`` (as
HAP's programs are), each device holding its share ``r_j`` of every split dim. Synthesis
(`astar.py`) prices an op at its slowest device — ``max_j r_j · t_j`` for split work, the
slowest ``t_j`` for replicated work — and collectives with the uneven formulas
(`meshplan.cost.collectives`); the balancer (`load_balance.py`) takes the program as phases
(one per kind of work: every op whose device times are proportional shares one phase) and
returns the ratios minimizing the step. The first ratios are the devices' matmul speeds
(DP-CP); the loop stops when the ratios settle or come back to those of an earlier round
(whose program is already known), or when a new round is no better than the best so far —
the pair that oscillates back is dropped and the best pair is kept.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from meshplan.cost.cluster import Cluster
from meshplan.cost.collectives import collective_cost, uneven_gather_impl
from meshplan.cost.compute import backward_factor, forward_backward_times
from meshplan.cost.devices import DeviceType
from meshplan.cost.memory import OptimizerState
from meshplan.cost.mesh import LogicalMesh, logical_mesh
from meshplan.cost.precision import DTYPES
from meshplan.ir.graph import Graph, Node
from meshplan.plan.plan import CollectiveEntry
from meshplan.planner.hetero.astar import SearchStats, synthesize
from meshplan.planner.hetero.load_balance import Device, Phase, balance
from meshplan.planner.intra.choices import IntraOptions, NodeChoices, resolve_choices
from meshplan.planner.intra.extract import extract, node_indices
from meshplan.planner.intra.formulate import CostContext, Formulation, OpCosts, formulate
from meshplan.planner.intra.ilp_problem import IlpSolution


@dataclass(frozen=True)
class Round:
    """One round of the loop: the ratios the program was synthesized for, its cost under
    them (seconds per step), and the balancer's step time for that program."""

    ratios: tuple[float, ...]
    synthesized_s: float
    balanced_s: float


@dataclass(frozen=True)
class HeteroResult:
    """The best (program, ratios) pair found, with what it took."""

    form: Formulation
    solution: IlpSolution
    ratios: tuple[float, ...]
    rounds: tuple[Round, ...]
    synthesis_s: float
    balance_s: float
    stats: SearchStats


@dataclass(frozen=True)
class StepSettings:
    """What the cost model needs besides the mesh: optimizer state, micro-batches,
    recomputation, and how uneven shards are gathered."""

    optimizer: OptimizerState = OptimizerState()
    microbatches: int = 1
    recompute: bool = False
    gather_impl: str = "auto"


def speed_shares(types: tuple[DeviceType, ...], dtype: str) -> tuple[float, ...]:
    """Ratios proportional to each device's matmul FLOP/s at ``dtype`` ("fp32" or
    "float32" style; HAP's DP-CP)."""
    speeds = [t.matmul_flops(DTYPES.get(dtype, dtype)) for t in types]
    return tuple(s / math.fsum(speeds) for s in speeds)


def flat_mesh(cluster: Cluster, ratios: tuple[float, ...], gather_impl: str = "auto"
              ) -> LogicalMesh:
    """Every device of ``cluster`` in one row, each with its share of a split dim."""
    mesh = logical_mesh(cluster, (1, cluster.num_devices))
    return replace(mesh, weights=((1.0,), tuple(ratios)), gather_impl=gather_impl)


def hetero_context(cluster: Cluster, ratios: tuple[float, ...], step: StepSettings
                   ) -> CostContext:
    """Costs on ``cluster`` with ``ratios``: each device of its own type (`CostContext`)."""
    return CostContext(flat_mesh(cluster, ratios, step.gather_impl), cluster.device,
                       step.optimizer, microbatches=step.microbatches,
                       recompute=step.recompute, devices=cluster.types)


def flat_choices(graph: Graph, cluster: Cluster, opts: IntraOptions) -> NodeChoices:
    return resolve_choices(graph, (1, cluster.num_devices), opts)


def alternate(graph: Graph, cluster: Cluster, opts: IntraOptions, step: StepSettings,
              budget: float | None, dtype: str, *, max_rounds: int = 8,
              tolerance: float = 1e-4, fixed: tuple[float, ...] | None = None) -> HeteroResult:
    """The loop of the module docstring; ``fixed`` ratios: the program for them alone (one
    round, no balancing). Raises InfeasibleIlpError when no program fits ``budget``."""
    nc = flat_choices(graph, cluster, opts)
    ratios = fixed or speed_shares(cluster.types, dtype)
    if fixed is not None:
        max_rounds = 1
    rounds: list[Round] = []
    best: tuple[float, Formulation, IlpSolution, tuple[float, ...], SearchStats] | None = None
    synth_s = lp_s = 0.0
    bound = False   # the budget binds: the ILP solves the next rounds' programs
    for _ in range(max_rounds):
        t0 = time.perf_counter()
        form = formulate(nc, hetero_context(cluster, ratios, step), budget)
        sol, stats = synthesize(form.problem, memory_bound=bound)
        bound = stats.solver == "ilp"
        t1 = time.perf_counter()
        phases, devices, shared = program_phases(form, sol.choices)
        found = balance(phases, devices, shared)
        lp_s += time.perf_counter() - t1
        synth_s += t1 - t0
        rounds.append(Round(ratios, sol.objective, found.step_s))
        if best is not None and sol.objective >= best[0] * (1 - 1e-9):
            break   # no better than a pair already found: the loop went back
        best = (sol.objective, form, sol, ratios, stats)
        new = tuple(found.ratios)
        if any(max(abs(a - b) for a, b in zip(new, r.ratios)) < tolerance for r in rounds):
            break   # settled, or back at ratios a round has synthesized for (the same program)
        ratios = new
    assert best is not None
    _, form, sol, ratios, stats = best
    return HeteroResult(form, sol, ratios, tuple(rounds), synth_s, lp_s, stats)


def program_phases(form: Formulation, choices: tuple[int, ...],
                   segment_of: Mapping[str, int] | None = None,
                   resplit: Sequence[tuple[int, CollectiveEntry]] = ()
                   ) -> tuple[list[Phase], list[Device], list[float]]:
    """The program ``choices`` as the balancer sees it: phases, devices (memory and the
    bytes held whatever the share) and, per segment, the bytes shared by its ratios.
    ``segment_of`` cuts it into model segments (`segments.py`; none: one), ``resplit`` adds
    the all-to-alls re-cutting values between them, each in its segment."""
    ctx = form.ctx
    seg = segment_of or {}
    nc, idx = form.choices, node_indices(form, choices)
    costs = OpCosts(nc, ctx)
    types = ctx.devices or (ctx.device,) * ctx.mesh.num_devices
    n = len(types)
    split: dict[tuple, list[float]] = defaultdict(lambda: [0.0] * n)
    fixed: dict[tuple, list[float]] = defaultdict(lambda: [0.0] * n)
    state = 0.0
    shared = [0.0] * (max(seg.values(), default=0) + 1)
    whole = {costs.sfb[p.name].consumer for p in nc.graph.params()
             if nc.choices[p.name][idx[p.name]].mode == "sfb"}
    for node in nc.graph.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        held = costs.memory(node, choice)
        k = seg.get(node.name, 0)
        if 1 in choice.strategy.output.split_axes:
            shared[k] += held * n
        else:
            state += held
        if ctx.device is None or node.is_source or node.flops == 0:
            continue
        times = [_op_seconds(node, t, ctx) for t in types]
        if node.name in whole:   # an SFB weight's gradient: over the whole batch everywhere
            dw = [_op_seconds(node, t, ctx, forward_only=True) for t in types]
            _add(fixed, dw, 0)
            times = [t - d for t, d in zip(times, dw)]
        if 1 in choice.strategy.work_axes:
            _add(split, times, k)
        else:
            _add(fixed, times, 0)
    phases = [Phase(0.0, split_s=tuple(v), segment=key[0]) for key, v in split.items()]
    phases += [Phase(0.0, fixed_s=tuple(v)) for v in fixed.values()]
    phases += _communication(form, choices, n, seg, resplit, len(shared))
    devices = [Device(1.0, float(t.memory_bytes), state) for t in types]
    return phases, devices, shared


def _add(phases: dict[tuple, list[float]], times: list[float], segment: int) -> None:
    """Add per-device ``times`` to the phase of their speed ratios in ``segment`` (one phase
    per ratio set and segment)."""
    key = tuple(round(t / times[0], 9) for t in times) if times[0] else tuple(times)
    for j, t in enumerate(times):
        phases[(segment, key)][j] += t


def _op_seconds(node: Node, device: DeviceType, ctx: CostContext, *,
                forward_only: bool = False) -> float:
    """Seconds one device takes for the whole of ``node`` per step (``forward_only``: one
    forward per micro-batch, the FLOPs of a contraction's weight gradient)."""
    dtype = node.out.dtype if node.out.dtype in ("float16", "bfloat16") else "float32"
    f, b = forward_backward_times(node.flops, node.nbytes, device, dtype, backward_factor(
        node.op, node.sig.kind if node.sig is not None else None))
    return ctx.microbatches * (f if forward_only else f * (1 + ctx.recompute) + b)


def _communication(form: Formulation, choices: tuple[int, ...], n: int,
                   segment_of: Mapping[str, int],
                   resplit: Sequence[tuple[int, CollectiveEntry]], segments: int) -> list[Phase]:
    """The program's collectives as one phase per segment (each owned by its op's segment):
    latency and ratio-free seconds as constants, the padded ones' bytes per unit of the
    largest share (an all-to-all's, whose padding grows with the square of it, linearized at
    the current ratios; a re-cut's, each device receiving its new share, linear)."""
    mesh = form.ctx.mesh
    result = extract(form, choices, form.ctx)
    constant, per_share = [0.0] * segments, [0.0] * segments
    top = max(mesh.shares((1,)))
    every = [(segment_of.get(owner, 0), c, False) for owner, c in result.owned]
    every += [(k, c, True) for k, c in resplit]
    for k, c, recut in every:
        cost = c.count * collective_cost(c.kind, mesh, c.mesh_axes, c.bytes)
        impl = uneven_gather_impl(mesh, c.mesh_axes, c.bytes)
        live = tuple(a for a in c.mesh_axes if mesh.shape[a] > 1)
        if (impl == "ring" and not recut) or not live:
            constant[k] += cost
            continue
        alpha = max(mesh.alpha[a] for a in live)
        beta = max(mesh.beta[a] for a in live)
        if recut:
            constant[k] += c.count * alpha
            per_share[k] += c.count * c.bytes * beta
        elif c.kind in ("all_gather", "reduce_scatter") and impl == "padded":
            constant[k] += c.count * alpha
            per_share[k] += c.count * (n - 1) * c.bytes * beta
        elif c.kind == "all_to_all":
            constant[k] += c.count * alpha
            per_share[k] += c.count * (n - 1) * c.bytes * beta * top
        else:
            constant[k] += cost
    return [Phase(0.0, fixed_s=(constant[k],) * n, beta_s_per_share=per_share[k], segment=k)
            for k in range(segments)]
