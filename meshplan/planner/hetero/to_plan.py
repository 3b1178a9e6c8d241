"""Plans for a cluster of mixed devices: HAP's synthesized program with balanced shard ratios
(method "hetero"), and its baselines, data parallelism with an even batch split ("dp-even",
HAP's DP-EV) or one proportional to the devices' speeds ("dp-proportional", DP-CP) — as HAP
ran them, PyTorch DDP: replicated updates, no ZeRO.

Each is one SPMD program over all devices as a ``(1, n)`` mesh whose axis 1 carries the
per-device ratios (the plan's ``axis_weights``; the runtime cuts every split dim by them), and
is priced device by device (`alternate.hetero_context`). The homogeneous ILP's plan on the same
cluster is method "intra-only": even shares, paced by the slowest device.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

from meshplan.cost.cluster import Cluster
from meshplan.ir.graph import Graph
from meshplan.plan.plan import Plan
from meshplan.planner.hetero.alternate import (HeteroResult, StepSettings, alternate,
                                               flat_choices, hetero_context, speed_shares)
from meshplan.planner.hetero.alternate import program_phases
from meshplan.planner.hetero.astar import synthesize
from meshplan.planner.hetero.load_balance import balance
from meshplan.planner.hetero.segments import (cut_segments, ratio_weights, resplit_entries,
                                              resplits, segmented_plan)
from meshplan.planner.intra.choices import IntraOptions
from meshplan.planner.intra.formulate import formulate
from meshplan.planner.intra.to_plan import intra_plan

HETERO_METHODS = ("hetero", "dp-even", "dp-proportional")


def plan_mixed(graph: Graph, fingerprint: str, cluster: Cluster, method: str,
               opts: IntraOptions, step: StepSettings, budget: float | None, *, dtype: str,
               name: str, optimizer: dict[str, Any], t0: float,
               ratios: tuple[float, ...] | None = None, segments: int = 1,
               segment_ratios: Sequence[Sequence[float]] | None = None) -> Plan:
    """The plan of one of `HETERO_METHODS` (module docstring); ``ratios`` (method "hetero"
    only) fixes the shard ratios instead of balancing them. ``segments`` > 1 (HAP §5.2) cuts
    the hetero program into that many model segments and balances a ratio set per segment,
    kept when it beats one set (`_segmented`); ``segment_ratios`` fixes one set per segment.
    Raises InfeasibleIlpError when nothing fits ``budget``."""
    if method == "hetero":
        found = alternate(graph, cluster, opts, step, budget, dtype, fixed=ratios)
        extra = _loop_record(found)
    else:
        n = cluster.num_devices
        ratios = (1.0 / n,) * n if method == "dp-even" else speed_shares(cluster.types, dtype)
        # HAP's DP-EV and DP-CP are PyTorch DDP: every parameter replicated, no ZeRO.
        dp = replace(opts, force_data_parallel=True, full_split=True, update_mode="replicated",
                     sfb="off")
        form = formulate(flat_choices(graph, cluster, dp), hetero_context(cluster, ratios, step),
                         budget)
        sol, stats = synthesize(form.problem)
        found = HeteroResult(form, sol, ratios, (), sol.solve_time_s, 0.0, stats)
        extra = {}
    ratios = tuple(float(r) for r in found.ratios)
    plan = intra_plan(found.form, found.solution, found.form.ctx.mesh, cluster, name=name,
                      fingerprint=fingerprint, method=method, optimizer=optimizer,
                      options=opts, budget=budget, search_time_s=time.perf_counter() - t0,
                      dtype=dtype, unsupported_ops=graph.unsupported_ops,
                      axis_weights=((1.0,), ratios))
    plan.options["gather_impl"] = step.gather_impl
    plan.options["hetero"] = {"ratios": list(ratios),
                              "device_types": [t.name for t in cluster.types],
                              "search_states": found.stats.generated,
                              "solver": found.stats.solver} | extra
    if method == "hetero" and (segments > 1 or segment_ratios):
        plan = _segmented(plan, found, graph, segments, segment_ratios)
    return plan


def _segmented(plan: Plan, found: HeteroResult, graph: Graph, count: int,
               fixed: Sequence[Sequence[float]] | None) -> Plan:
    """``plan`` cut into ``count`` model segments (`segments.cut_segments`) with a ratio set
    per segment from the LP over the program's phases with the re-cuts between segments — if
    that predicts a faster step than one set; ``fixed`` ratio sets are taken as given."""
    form, choices = found.form, found.solution.choices
    t0 = time.perf_counter()
    segment_of = cut_segments(graph, len(fixed) if fixed else count)
    if fixed:
        return segmented_plan(plan, form, choices, form.ctx, segment_of,
                              [ratio_weights(r) for r in fixed])
    candidates = resplits(graph, plan, segment_of, None)
    recuts = resplit_entries(candidates, plan.microbatches, plan.recompute)
    balanced = balance(*program_phases(form, choices, segment_of, recuts))
    cut = segmented_plan(plan, form, choices, form.ctx, segment_of,
                         [ratio_weights(r) for r in balanced.segments])
    one, many = plan.predicted["step_time_s"], cut.predicted["step_time_s"]
    record = {"count": count, "ratios": [list(r) for r in balanced.segments],
              "step_s": many, "one_set_step_s": one, "recuts": len(candidates),
              "kept": many < one, "balance_s": time.perf_counter() - t0}
    chosen = cut if many < one else plan
    return replace(chosen, options={**chosen.options, "hetero": {
        **chosen.options["hetero"], "segments": record}})


def _loop_record(found: HeteroResult) -> dict[str, Any]:
    return {"synthesis_s": found.synthesis_s, "balance_s": found.balance_s,
            "rounds": [{"synthesized_s": r.synthesized_s, "balanced_s": r.balanced_s}
                       for r in found.rounds]}


def check_mixed_request(method: str, mesh_shape: object, abstract: bool, num_devices: int,
                        axis_weights: Any) -> tuple[float, ...] | None:
    """Refuse what a mixed-device method cannot honour: a mesh (it plans one row of every
    device), abstract α/β units (its ratios trade seconds of compute against seconds of
    communication), or ratios other than one per device for "hetero" (the baselines fix
    their own). Returns the fixed ratios, if given."""
    if mesh_shape is not None:
        raise ValueError(f"method {method!r} plans every device as one row of the mesh, "
                         "(1, n), each with its own share: give no mesh_shape")
    if abstract:
        raise ValueError(f"method {method!r} prices compute and communication in seconds: "
                         "give no alpha/beta")
    if not axis_weights:
        return None
    if method != "hetero":
        raise ValueError(f"method {method!r} fixes its own shard ratios: give no axis_weights "
                         "(method 'hetero' takes them)")
    rows = [tuple(float(x) for x in w) for w in axis_weights]
    if len(rows) != 2 or len(rows[0]) != 1 or len(rows[1]) != num_devices \
            or min(rows[1]) < 0 or sum(rows[1]) <= 0:
        raise ValueError(f"method 'hetero' takes axis_weights ((1.0,), (r_0, ..., r_"
                         f"{num_devices - 1})): one non-negative ratio per device of the "
                         f"(1, {num_devices}) mesh; got {axis_weights!r}")
    return tuple(x / sum(rows[1]) for x in rows[1])



def check_segments(segments: Any, segment_ratios: Any, method: str, mixed_auto: bool,
                   num_devices: int, axis_weights: Any
                   ) -> tuple[int, tuple[tuple[float, ...], ...] | None]:
    """Refuse segment settings the plan cannot honour (only method "hetero", or "auto" on a
    mixed cluster, has segments; a count >= 1; fixed sets of one non-negative ratio per device
    each, not with ``axis_weights``). Returns (count, fixed ratio sets or None)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be an int >= 1, got {segments!r}")
    if (segments > 1 or segment_ratios) and method != "hetero" and not mixed_auto:
        raise ValueError(f"segments (HAP's per-segment shard ratios) apply to method 'hetero' "
                         f"(or 'auto' on a mixed cluster), not {method!r}")
    if not segment_ratios:
        return segments, None
    if axis_weights:
        raise ValueError("give segment_ratios or axis_weights, not both")
    sets = []
    for r in segment_ratios:
        row = tuple(float(x) for x in r) if isinstance(r, (list, tuple)) else ()
        if len(row) != num_devices or min(row) < 0 or sum(row) <= 0:
            raise ValueError(f"segment_ratios takes one list of {num_devices} non-negative "
                             f"ratios (a positive sum) per segment; got {r!r}")
        sets.append(tuple(x / sum(row) for x in row))
    if segments not in (1, len(sets)):
        raise ValueError(f"segments={segments} but segment_ratios gives {len(sets)} sets")
    return len(sets), tuple(sets)
