"""``meshplan diff a.json b.json``: what two plans of a model do differently — the summary side
by side, the stages, each parameter whose layout or update mode differs, and the bytes moved
per step by collective kind."""

from __future__ import annotations

from collections import Counter

from meshplan.plan.explain import format_bytes
from meshplan.plan.plan import Plan


def _params(plan: Plan) -> dict[str, tuple[str, str, str]]:
    """name -> (stage, layout, update) over every stage of the plan."""
    if len(plan.stages) <= 1:
        return {p.name: ("", p.spec, p.update) for p in plan.params}
    return {p.name: (str(s.index), p.spec, p.update)
            for s in plan.stages if s.plan is not None for p in s.plan.params}


def _bytes_by_kind(plan: Plan) -> Counter:
    out: Counter = Counter()
    plans = [plan] if len(plan.stages) <= 1 else [s.plan for s in plan.stages if s.plan]
    for p in plans:
        for c in p.collectives:
            out[c.kind] += c.count * c.bytes
    for t in plan.transfers:
        out["send/recv"] += t.count * t.bytes
    return out


def _stages(plan: Plan) -> list[str]:
    return [f"[{s.layers[0]}, {s.layers[1]}) on {len(s.devices)} devices "
            f"({s.mesh_shape[0]}x{s.mesh_shape[1]})" for s in plan.stages] or ["one stage"]


def diff_plans(a: Plan, b: Plan, names: tuple[str, str] = ("a", "b")) -> str:
    """The comparison of ``a`` and ``b`` as text (module docstring)."""
    rows = [("model", a.model, b.model), ("method", a.method, b.method),
            ("mesh", "x".join(map(str, a.mesh_shape)), "x".join(map(str, b.mesh_shape))),
            ("stages", len(a.stages) or 1, len(b.stages) or 1),
            ("schedule", a.schedule, b.schedule),
            ("micro-batches", a.microbatches, b.microbatches), ("dtype", a.dtype, b.dtype),
            ("predicted step (ms)", f"{a.predicted['step_time_s'] * 1e3:,.3f}",
             f"{b.predicted['step_time_s'] * 1e3:,.3f}"),
            ("peak memory", format_bytes(a.predicted["peak_memory_bytes"]),
             format_bytes(b.predicted["peak_memory_bytes"]))]
    width = max(34, *(len(str(x)) + 2 for _, x, _ in rows))
    out = [f"{'':<22}{names[0]:<{width}}{names[1]}"]
    out += [f"{k:<22}{str(x):<{width}}{y}" + ("" if x == y else "   *") for k, x, y in rows]
    if a.graph_fingerprint != b.graph_fingerprint:
        out.append("(the plans are of different programs: another model, batch or micro-batch size)")
    ratio = b.predicted["step_time_s"] / a.predicted["step_time_s"]
    out.append(f"{names[1]} takes {ratio:.3f}x the step time of {names[0]}")
    out += ["", "stages:"]
    sa, sb = _stages(a), _stages(b)
    for i in range(max(len(sa), len(sb))):
        x = sa[i] if i < len(sa) else "-"
        y = sb[i] if i < len(sb) else "-"
        out.append(f"  {i:<20}{x:<{width}}{y}")
    pa, pb = _params(a), _params(b)
    # Compared by layout and update mode; the stage holding it is shown, not compared.
    changed = [(n, pa.get(n), pb.get(n)) for n in sorted(set(pa) | set(pb))
               if (pa.get(n) or ("",))[1:] != (pb.get(n) or ("",))[1:]]
    out += ["", f"parameters laid out or updated differently: {len(changed)} of "
                f"{len(set(pa) | set(pb))}"]
    for n, x, y in changed[:50]:
        def fmt(v: tuple[str, str, str] | None) -> str:
            return "-" if v is None else (f"stage {v[0]} " if v[0] else "") + f"{v[1]} {v[2]}"
        out.append(f"  {n:<40}{fmt(x):<{width}}{fmt(y)}")
    if len(changed) > 50:
        out.append(f"  … and {len(changed) - 50} more")
    ba, bb = _bytes_by_kind(a), _bytes_by_kind(b)
    out += ["", "bytes moved per step:"]
    for kind in sorted(set(ba) | set(bb)):
        out.append(f"  {kind:<20}{format_bytes(ba[kind]):<{width}}{format_bytes(bb[kind])}")
    return "\n".join(out)
