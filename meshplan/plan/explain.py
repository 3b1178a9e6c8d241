"""Human-readable account of a plan: the summary, each op's choice and cost, the collectives."""

from __future__ import annotations

from meshplan.plan.plan import Plan

_HEAVY = ("mm", "bmm", "sdpa", "embedding")


def _fmt_bytes(n: float) -> str:
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
        f"{_fmt_bytes(plan.predicted['peak_memory_bytes'])} per device",
        f"  search           {plan.search_time_s:.2f} s (ILP: {plan.ilp['variables']} variables, "
        f"{plan.ilp['constraints']} constraints, solved in {plan.ilp['solve_time_s']:.2f} s)",
        "  parameter updates " + ", ".join(f"{k}: {v}" for k, v in sorted(modes.items())),
    ]
    if plan.options.get("unsupported_ops"):
        lines.append("  planned replicated (no signature): "
                     + ", ".join(plan.options["unsupported_ops"]))
    return "\n".join(lines)


def explain(plan: Plan, *, all_ops: bool = False) -> str:
    """The summary, per-op decisions with their costs, parameters and collectives.

    Only ops that compute something or communicate are listed unless ``all_ops``.
    """
    out = [summary(plan), "", "ops (strategy | operands -> output | compute, communication, "
           "resharding, memory):"]
    for o in plan.ops:
        if not all_ops and o.op not in _HEAVY and o.communication == o.resharding == 0:
            continue
        out.append(f"  {o.node:<28} {o.op:<12} {o.strategy:<14} | {' '.join(o.inputs)} -> "
                   f"{o.output} | {o.compute:.3g}, {o.communication:.6g}, {o.resharding:.6g}, "
                   f"{_fmt_bytes(o.memory_bytes)}")
    out += ["", "parameters (spec, storage, update, sync axes):"]
    for p in plan.params:
        out.append(f"  {p.name:<36} {p.spec:<8} {p.storage:<8} {p.update:<10} {p.sync_axes}")
    out += ["", "collectives per step (kind, bytes, mesh axes, phase, count):"]
    for c in plan.collectives:
        out.append(f"  {c.kind:<15} {c.bytes:>14,} {str(c.mesh_axes):<8} {c.phase:<9} x{c.count}")
    if not plan.collectives:
        out.append("  none")
    return "\n".join(out)
