"""Human-readable account of a plan: the summary, each op's choice and cost, the collectives."""

from __future__ import annotations

from meshplan.plan.plan import Plan
from meshplan.planner.recompute import replay_text

_HEAVY = ("mm", "bmm", "matmul", "sdpa", "embedding")


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below 1024 of it (B, KiB, … TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def summary(plan: Plan) -> str:
    """A few lines: mesh, method, objective, prediction, search time and ILP size."""
    modes: dict[str, int] = {}
    for p in plan.params:
        modes[p.update] = modes.get(p.update, 0) + 1
    lines = [
        f"meshplan plan for {plan.model} on a {plan.mesh_shape[0]}x{plan.mesh_shape[1]} mesh "
        f"({plan.cluster.get('name', '?')}), method {plan.method}",
        f"  objective        {plan.objective:,.6g} {plan.objective_units}",
        f"  predicted step   {plan.predicted['step_time_s'] * 1e3:,.3f} ms, peak memory "
        f"{format_bytes(plan.predicted['peak_memory_bytes'])} per device",
        f"  search           {plan.search_time_s:.2f} s ({_search(plan)})",
        f"  training step    {plan.dtype}, {plan.microbatches} micro-batch"
        f"{'es' if plan.microbatches != 1 else ''}"
        f"{', ' + replay_text(plan) if plan.recompute and plan.num_stages <= 1 else ''}"
        f"{', recomputed' if plan.recompute and plan.num_stages > 1 else ''}, "
        f"{_stage_count(plan)}",
    ]
    loss = plan.options.get("microbatch_loss")
    if loss is not None:   # how the micro-batches make the full batch's step
        kinds = ", ".join(f"{kind} ({node})" for node, kind in loss["reductions"])
        lines.append("  micro-batches    " + (
            f"the full batch's step: the loss's batch reductions scaled per micro-batch: "
            f"{kinds}" if loss["exact"] else
            f"averaged (not the full batch's step exactly: {loss['why']})"))
    if "megatron" in plan.options:
        lines.append(_megatron(plan.options))
    if "mixed_auto" in plan.options:   # auto on a cluster of mixed devices: what it weighed
        steps = plan.options["mixed_auto"]["step_s"]
        lines.append("  mixed devices    chose " + plan.options["mixed_auto"]["chosen"] + " of "
                     + ", ".join(f"{k} {v * 1e3:,.3f} ms" if v is not None else f"{k} none"
                                 for k, v in steps.items()))
    if "single_stage_check" in plan.options:   # auto: pipeline against intra-only's plan
        check = plan.options["single_stage_check"]
        lines.append(f"  intra-only check chose the {check['chosen']}: " + ", ".join(
            f"{k} {v * 1e3:,.3f} ms"
            + (" (over the budget as simulated)" if k in check["over_budget_simulated"] else "")
            for k, v in check["step_s"].items()))
    if "hetero" in plan.options or any(len(set(w)) > 1 for w in plan.axis_weights):
        lines.append(_ratios(plan))
    if plan.params:
        lines.append("  parameter updates "
                     + ", ".join(f"{k}: {v}" for k, v in sorted(modes.items())))
    if plan.options.get("unsupported_ops"):
        lines.append("  planned replicated (no signature): "
                     + ", ".join(plan.options["unsupported_ops"]))
    return "\n".join(lines)


def _stage_count(plan: Plan) -> str:
    """"2 stages (1f1b)", or under interleaving "2 stages x 3 chunks (interleaved 1F1B)"."""
    n = plan.num_meshes
    text = f"{n} stage{'s' if n != 1 else ''}"
    if plan.chunks > 1:
        return (f"{text} x {plan.chunks} chunks (interleaved 1F1B, {plan.num_stages} virtual "
                "stages)")
    return text + (f" ({plan.schedule})" if n > 1 else "")


def _megatron(options: dict) -> str:
    """The Megatron configuration of a "megatron:.." or "megatron-grid" plan."""
    c = options["megatron"]
    line = f"  megatron: dp={c['dp']},tp={c['tp']},pp={c['pp']},mb={c['mb']}"
    if c.get("virtual", 1) > 1:
        line += f",virtual={c['virtual']}"
    grid = options.get("megatron_grid")
    if grid:
        fit = sum(r["step_time_s"] is not None for r in grid)
        line += f" (the fastest of {fit} configurations that fit, {len(grid)} priced)"
    return line


def _ratios(plan: Plan) -> str:
    """Each device type's share of every split dim (and how the ratios were found)."""
    info = plan.options.get("hetero")
    if not info:
        return "  shard weights    " + "; ".join(
            f"axis {a}: " + ", ".join(f"{x:g}" for x in w) for a, w in enumerate(plan.axis_weights))
    line = f"  shard ratios     {_shares(info['device_types'], info['ratios'])} (of every " \
           "split dim, per device)"
    if info.get("rounds"):
        line += (f"\n  ratio search     {len(info['rounds'])} round(s) of synthesis "
                 f"({info['synthesis_s']:.2f} s) and LP ({info['balance_s']:.2f} s); uneven "
                 f"gathers: {plan.options.get('gather_impl', 'auto')}")
    seg = info.get("segments")
    if seg and not seg["kept"]:
        many, one = seg["step_s"] * 1e3, seg["one_set_step_s"] * 1e3
        line += (f"\n  segments         {seg['count']} segments with ratios of their own "
                 f"predicted {many:,.3f} ms, one set {one:,.3f} ms: one set kept")
    if plan.segment_weights:
        counts = [0] * len(plan.segment_weights)
        for k in plan.segment_of.values():
            counts[k] += 1
        recuts = plan.options.get("segment_recuts", 0)
        rest = line.partition("\n")[2]   # the ratio search, the one-set ratios replaced
        line = "  shard ratios     per model segment (of every split dim, per device):"
        for k, w in enumerate(plan.segment_weights):
            line += (f"\n  {'':<16} segment {k} ({counts[k]} nodes): "
                     f"{_shares(info['device_types'], w[1])}")
        line += (f"\n  {'':<16} {recuts} value(s) re-cut between segments (an all-to-all "
                 "each per micro-batch, forward and backward)") + (f"\n{rest}" if rest else "")
    return line


def _shares(types: list[str], ratios: list[float] | tuple[float, ...]) -> str:
    """Each device type's share, equal neighbours counted once."""
    groups: dict[tuple[str, float], int] = {}
    for name, r in zip(types, ratios):
        key = (name, round(r, 4))
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(f"{name} x{n}: {r:.4f}" for (name, r), n in groups.items())


def _search(plan: Plan) -> str:
    ilp = plan.ilp
    if "hetero" in plan.options:
        info = plan.options["hetero"]
        via = " (memory-bound: proved by the ILP)" if info.get("solver") == "ilp" else ""
        return (f"program synthesis (A*): {ilp['variables']} decisions, "
                f"{info['search_states']} states{via}, {ilp['solve_time_s']:.2f} s")
    if "variables" in ilp:
        return (f"ILP: {ilp['variables']} variables, {ilp['constraints']} constraints, solved "
                f"in {ilp['solve_time_s']:.2f} s")
    return (f"{ilp.get('stage_solves', 0)} stage ILPs, {ilp.get('tmax_tried', 0)} t_max "
            f"values in the stage DP")


def stages_table(plan: Plan) -> list[str]:
    """One line per pipeline stage: layers, devices, submesh, logical mesh, recompute,
    micro-batches in flight, latency per micro-batch, peak memory."""
    layers = f"{plan.num_layers} layer{'s' if plan.num_layers != 1 else ''}"
    out = [f"stages ({layers}; per micro-batch latency, peak memory per device):"]
    mixed = isinstance(plan.cluster.get("hosts"), list) and plan.num_stages > 1
    for s in plan.stages:
        devs = device_runs(s.devices)
        if mixed and s.plan is not None:   # typed stages: the device each is priced on
            device = s.plan.cluster.get("device")
            devs += f" [{device['name'] if isinstance(device, dict) else device}]"
        out.append(f"  stage {s.index}: layers [{s.layers[0]}, {s.layers[1]}) on devices "
                   f"{devs} (submesh {s.submesh[0]}x{s.submesh[1]}, mesh "
                   f"{s.mesh_shape[0]}x{s.mesh_shape[1]}){', ' + replay_text(s) if s.recompute else ''}"
                   f", {s.in_flight} in flight, {s.latency_s * 1e3:,.3f} ms, "
                   f"{format_bytes(s.memory_bytes)}")
        if s.tradeoffs:
            out.append(f"    for memory: {tradeoffs_text(s.tradeoffs)}")
    return out


def _seconds(x: float) -> str:
    return f"{x:,.3f} s" if x >= 1 else f"{x * 1e3:,.3f} ms"


def tradeoffs_text(t: dict[str, float]) -> str:
    """What a stage gave up for memory and what it bought (`StagePlan.tradeoffs`)."""
    parts = []
    if "recompute_saved_bytes" in t:
        parts.append(f"the replay saves {format_bytes(t['recompute_saved_bytes'])} per device "
                     f"and costs {_seconds(t['recompute_cost_s'])} a step")
    modes = [f"ZeRO-{k[4]} on {int(t[k])} parameter{'s' * (int(t[k]) != 1)}"
             for k in ("zero3_params", "zero2_params") if t.get(k)]
    if modes:
        parts.append(f"{' and '.join(modes)} save {format_bytes(t['zero_saved_bytes'])} of "
                     "state per device against replicated updates")
    return "; ".join(parts)


def device_runs(devices: tuple[int, ...]) -> str:
    """Device ids as runs: "0-3,8-11"."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def explain(plan: Plan, *, all_ops: bool = False) -> str:
    """The summary, per-op decisions with their costs, parameters and collectives; for a
    plan of several stages, the stages and then each stage's own plan.

    Only ops that compute something or communicate are listed unless ``all_ops``.
    """
    if plan.num_stages > 1:
        parts = [summary(plan), "", *stages_table(plan)]
        for s in plan.stages:
            assert s.plan is not None
            parts += ["", f"--- stage {s.index} ---", explain(s.plan, all_ops=all_ops)]
        return "\n".join(parts)
    out = [summary(plan)]
    if plan.stages:
        out += ["", *stages_table(plan)]
    out += ["", "ops (strategy | operands -> output | compute, communication, "
           "resharding, memory):"]
    for o in plan.ops:
        if not all_ops and o.op not in _HEAVY and o.communication == o.resharding == 0:
            continue
        out.append(f"  {o.node:<28} {o.op:<12} {o.strategy:<14} | {' '.join(o.inputs)} -> "
                   f"{o.output} | {o.compute:.3g}, {o.communication:.6g}, {o.resharding:.6g}, "
                   f"{format_bytes(o.memory_bytes)}")
    out += ["", "parameters (spec, storage, update, sync axes):"]
    for p in plan.params:
        out.append(f"  {p.name:<36} {p.spec:<8} {p.storage:<8} {p.update:<10} {p.sync_axes}")
    out += ["", "collectives per step (kind, bytes, mesh axes, phase, count):"]
    for c in plan.collectives:
        out.append(f"  {c.kind:<15} {c.bytes:>14,} {str(c.mesh_axes):<8} {c.phase:<9} x{c.count}")
    if not plan.collectives:
        out.append("  none")
    return "\n".join(out)
