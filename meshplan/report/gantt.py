"""A simulated step as a Gantt chart: one row per stage mesh, forward, backward, update and
waiting in their own colours, micro-batch numbers on the tasks, transfers as thin bars under
their sending mesh's row.

matplotlib is an optional dependency (``pip install meshplan[report]``); asking for a chart
without it raises an error saying so.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.sim.engine import Timeline

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868", "wait": "#DDDDDD"}


def write_gantt(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Draw ``timeline`` into the PNG ``path``; returns the path. Raises RuntimeError when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the Gantt chart needs matplotlib: pip install 'meshplan[report]'"
                           ) from e
    n = timeline.num_meshes
    scale, unit = _unit(timeline.step_time_s)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * n))
    label_room = timeline.step_time_s * scale / 40
    for s in timeline.spans:
        width = (s.end - s.start) * scale
        ax.broken_barh([(s.start * scale, width)], (s.mesh - 0.35, 0.6),
                       facecolors=COLOURS[s.what], edgecolor="white", linewidth=0.3)
        if s.microbatch >= 0 and s.what != "wait" and width > label_room:
            ax.text((s.start + s.end) / 2 * scale, s.mesh - 0.05, str(s.microbatch),
                    ha="center", va="center", fontsize=7, color="white")
    for t in timeline.transfers:
        ax.broken_barh([(t.start * scale, (t.end - t.start) * scale)], (t.src_mesh + 0.3, 0.08),
                       facecolors="#8172B3")
    ax.set_yticks(range(n), [f"mesh {m}" for m in range(n)])
    ax.set_ylim(n - 0.5, -0.6)
    ax.set_xlim(0, timeline.step_time_s * scale)
    ax.set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#8172B3"))
    ax.legend(handles, [*COLOURS, "transfer"], loc="center left", fontsize=8,
              bbox_to_anchor=(1.0, 0.5), frameon=False)
    ax.set_title(title or f"simulated step: {timeline.step_time_s * scale:.4g} {unit}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"
