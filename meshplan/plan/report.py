"""A plan as one self-contained HTML page (``meshplan report plan.json -o plan.html``): inline
CSS and SVG, nothing fetched when it is viewed.

Sections: the summary; the cluster drawn as hosts of devices coloured by the stage they run;
the stages; the per-layer sharding (each stage's parameters: layout, storage, update mode) and
its sharded ops; the pipeline timeline as a Gantt chart and memory per device against its
limit, both from the simulator (`meshplan.sim`); collectives by kind and mesh axes (which
links they cross) with their predicted seconds, and the messages between stages.
"""

from __future__ import annotations

import html
from collections import defaultdict
from typing import Any

from meshplan.cost.cluster import cluster_from_dict
from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import logical_mesh
from meshplan.plan.explain import device_runs, format_bytes
from meshplan.plan.plan import Plan
from meshplan.planner.recompute import replay_text

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
WHAT = {"forward": "#4e79a7", "backward": "#f28e2b", "update": "#59a14f", "wait": "#dddddd"}
MAX_OP_ROWS = 200   # per stage: a 39B model has thousands of ops

CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.legend span{display:inline-block;margin-right:14px;font-size:13px}
.sw{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(
            f"<td class='num'>{_e(c)}</td>" if i in numeric else f"<td>{_e(c)}</td>"
            for i, c in enumerate(r)) + "</tr>")
    return "".join(out) + "</table>"


def _stage_of_device(plan: Plan, n: int) -> list[int]:
    out = [0] * n
    for s in plan.stages or ():
        for d in s.devices:
            out[d] = s.index % (len(plan.stages) // max(plan.chunks, 1) or 1)
    return out


def cluster_svg(plan: Plan) -> str:
    """Hosts as rows of devices, each coloured by its stage (mesh) and named by id and type."""
    cl = cluster_from_dict(plan.cluster)
    stage = _stage_of_device(plan, cl.num_devices)
    size, gap, label = 34, 4, 210
    per = cl.devices_per_host
    width = label + per * (size + gap) + 10
    height = cl.num_hosts * (size + 2 * gap) + 10
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "role='img' aria-label='cluster'>"]
    for h in range(cl.num_hosts):
        y = 5 + h * (size + 2 * gap)
        kind = cl.types[h * per].name
        parts.append(f"<text x='4' y='{y + size / 2 + 4}' font-size='12'>host {h}: "
                     f"{_e(kind[:22])}</text>")
        for j in range(per):
            d = h * per + j
            x = label + j * (size + gap)
            colour = PALETTE[stage[d] % len(PALETTE)]
            parts.append(f"<rect x='{x}' y='{y}' width='{size}' height='{size}' rx='4' "
                         f"fill='{colour}'><title>device {d} ({_e(cl.types[d].name)}), "
                         f"stage {stage[d]}</title></rect>"
                         f"<text x='{x + size / 2}' y='{y + size / 2 + 4}' font-size='11' "
                         f"text-anchor='middle' fill='white'>{d}</text>")
    return "".join(parts) + "</svg>"


def gantt_svg(spans: list[Any], num_meshes: int, step_s: float) -> str:
    """One lane per mesh: forward, backward, update and waits over one simulated step."""
    width, lane, left = 1100, 26, 70
    height = num_meshes * lane + 30
    scale = (width - left - 10) / step_s if step_s > 0 else 0.0
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "role='img' aria-label='pipeline timeline'>"]
    for m in range(num_meshes):
        parts.append(f"<text x='4' y='{m * lane + 17}' font-size='12'>mesh {m}</text>")
    for s in spans:
        x, w = left + s.start * scale, max((s.end - s.start) * scale, 0.5)
        label = f"{s.what} stage {s.stage}" + (f" mb {s.microbatch}" if s.microbatch >= 0
                                                else "")
        parts.append(f"<rect x='{x:.2f}' y='{s.mesh * lane + 3}' width='{w:.2f}' "
                     f"height='{lane - 6}' fill='{WHAT.get(s.what, '#999')}'>"
                     f"<title>{_e(label)}: {s.start * 1e3:.3f}-{s.end * 1e3:.3f} ms</title>"
                     "</rect>")
    parts.append(f"<text x='{left}' y='{height - 6}' font-size='11'>0</text>"
                 f"<text x='{width - 10}' y='{height - 6}' font-size='11' text-anchor='end'>"
                 f"{step_s * 1e3:.3f} ms</text>")
    return "".join(parts) + "</svg>"


def memory_svg(peaks: tuple[float, ...], limit: float | None) -> str:
    """Peak memory per device as bars, the device limit as a line."""
    width, height, bottom = 1100, 180, 20
    top = max([*peaks, limit or 0.0, 1.0])
    bar = max(2.0, (width - 20) / max(len(peaks), 1) - 2)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "role='img' aria-label='memory per device'>"]
    for d, b in enumerate(peaks):
        h = (height - bottom - 10) * b / top
        over = limit is not None and b > limit
        parts.append(f"<rect x='{10 + d * (bar + 2):.1f}' y='{height - bottom - h:.1f}' "
                     f"width='{bar:.1f}' height='{h:.1f}' "
                     f"fill='{'#e15759' if over else '#4e79a7'}'><title>device {d}: "
                     f"{_e(format_bytes(b))}</title></rect>")
    if limit:
        y = height - bottom - (height - bottom - 10) * limit / top
        parts.append(f"<line x1='0' x2='{width}' y1='{y:.1f}' y2='{y:.1f}' stroke='#e15759' "
                     f"stroke-dasharray='6 4'/><text x='{width - 4}' y='{y - 4:.1f}' "
                     f"font-size='11' text-anchor='end'>limit {_e(format_bytes(limit))}</text>")
    return "".join(parts) + "</svg>"


def _stage_plans(plan: Plan) -> list[tuple[str, Plan]]:
    if len(plan.stages) <= 1:
        return [("the whole mesh", plan)]
    return [(f"stage {s.index}: layers [{s.layers[0]}, {s.layers[1]})", s.plan)
            for s in plan.stages if s.plan is not None]


def _collectives(plan: Plan) -> str:
    """Per kind and mesh axes, the bytes moved per step and their predicted seconds."""
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for _, p in _stage_plans(plan):
        mesh = logical_mesh(cluster_from_dict(p.cluster), tuple(p.mesh_shape))
        for c in p.collectives:
            live = tuple(a for a in c.mesh_axes if p.mesh_shape[a] > 1)
            link = "inter-host" if len(live) and cluster_from_dict(p.cluster).num_hosts > 1 \
                and 0 in live else "intra-host"
            key = (c.kind, f"{c.phase}, axes {tuple(c.mesh_axes)} ({link})")
            rows[key][0] += c.count
            rows[key][1] += c.count * c.bytes
            rows[key][2] += c.count * collective_cost(c.kind, mesh, c.mesh_axes, c.bytes)
    table = [[k, w, int(n), format_bytes(b), f"{s * 1e3:,.3f}"]
             for (k, w), (n, b, s) in sorted(rows.items(), key=lambda kv: -kv[1][2])]
    out = _table(["kind", "phase, mesh axes (link)", "count", "bytes", "ms"], table, {2, 3, 4})
    if plan.transfers:
        moved: dict[tuple[int, int, str], list[float]] = defaultdict(lambda: [0, 0.0])
        for t in plan.transfers:
            moved[(t.src, t.dst, t.kind)][0] += t.count
            moved[(t.src, t.dst, t.kind)][1] += t.count * t.bytes
        out += "<p>Point-to-point messages between stages per step:</p>" + _table(
            ["from device", "to device", "kind", "messages", "bytes"],
            [[s, d, k, int(n), format_bytes(b)] for (s, d, k), (n, b) in sorted(moved.items())],
            {3, 4})
    return out


def _sharding(plan: Plan) -> str:
    parts = []
    stages = _stage_plans(plan)
    shown = " open" if len(stages) == 1 else ""   # a pipeline's: one click per stage
    for title, p in stages:
        params = _table(["parameter", "layout", "storage", "update", "sync axes"],
                        [[x.name, x.spec, x.storage, x.update, tuple(x.sync_axes)]
                         for x in p.params])
        split = [o for o in p.ops if o.strategy != "replicated"]
        ops = _table(["op", "aten", "strategy", "output"],
                     [[o.node, o.op, o.strategy, o.output] for o in split[:MAX_OP_ROWS]])
        more = f"<p>… and {len(split) - MAX_OP_ROWS} more sharded ops.</p>" \
            if len(split) > MAX_OP_ROWS else ""
        parts.append(f"<details{shown}><summary>{_e(title)}: {len(p.params)} parameters, "
                     f"{len(split)} sharded ops</summary>{params}<details><summary>sharded "
                     f"ops</summary>{ops}{more}</details></details>")
    return "".join(parts)


def render_report(plan: Plan) -> str:
    """The HTML page of ``plan`` (module docstring)."""
    from meshplan.sim.simulate import simulate
    sim = simulate(plan)
    cl = cluster_from_dict(plan.cluster)
    pred = plan.predicted
    meshes = max(len(plan.stages) // max(plan.chunks, 1), 1)
    legend = "".join(
        f"<span><i class='sw' style='background:{PALETTE[s.index % len(PALETTE)]}'></i>"
        f"stage {s.index}: layers [{s.layers[0]}, {s.layers[1]})</span>"
        for s in (plan.stages[:meshes] if plan.stages else ()))
    stages = _table(
        ["stage", "layers", "devices", "submesh", "mesh", "recompute", "in flight",
         "latency ms", "memory"],
        [[s.index, f"[{s.layers[0]}, {s.layers[1]})", device_runs(s.devices),
          f"{s.submesh[0]}x{s.submesh[1]}", f"{s.mesh_shape[0]}x{s.mesh_shape[1]}",
          replay_text(s).removeprefix("recomputed: ") or "no", s.in_flight,
          f"{s.latency_s * 1e3:,.3f}", format_bytes(s.memory_bytes)]
         for s in plan.stages], {6, 7})
    summary = _table(["", ""], [
        ["model", plan.model], ["cluster", f"{cl.name}: {cl.num_hosts} x "
                                f"{cl.devices_per_host} devices"],
        ["method", plan.method], ["stages", f"{len(plan.stages) or 1} ({plan.schedule}, "
                                  f"{plan.microbatches} micro-batches)"],
        ["dtype", plan.dtype],
        ["predicted step", f"{pred['step_time_s'] * 1e3:,.3f} ms"],
        ["simulated step", f"{sim.step_time_s * 1e3:,.3f} ms "
                           f"({sim.samples_per_s:,.1f} samples/s, bubble "
                           f"{sim.bubble_fraction:.1%})"],
        ["peak memory", f"{format_bytes(pred['peak_memory_bytes'])} per device"],
        ["search", f"{plan.search_time_s:.2f} s"]])
    limit = plan.options.get("memory_budget_bytes") or cl.device.memory_bytes
    body = [
        f"<h1>meshplan plan: {_e(plan.model)}</h1>", "<section id='summary'>", summary,
        "</section>",
        "<h2>Cluster</h2><section id='cluster'>", cluster_svg(plan),
        f"<p class='legend'>{legend}</p></section>",
        "<h2>Stages</h2><section id='stages'>", stages, "</section>",
        "<h2>Sharding per layer</h2><section id='sharding'>", _sharding(plan), "</section>",
        "<h2>Pipeline timeline</h2><section id='timeline'>",
        gantt_svg(list(sim.timeline.spans), sim.timeline.num_meshes, sim.step_time_s),
        "<p class='legend'>" + "".join(f"<span><i class='sw' style='background:{c}'></i>{w}"
                                       "</span>" for w, c in WHAT.items()) + "</p></section>",
        "<h2>Memory per device</h2><section id='memory'>",
        memory_svg(sim.peak_memory_bytes, limit), "</section>",
        "<h2>Collectives</h2><section id='collectives'>", _collectives(plan), "</section>"]
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>meshplan: {_e(plan.model)}</title><style>{CSS}</style></head><body>"
            + "".join(body) + "</body></html>")
