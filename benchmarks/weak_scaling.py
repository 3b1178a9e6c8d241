"""Weak scaling (Alpa's Fig. 7), simulated: each method's plan of Alpa's GPT, MoE and Wide-ResNet
rows on p3.16xlarge (1-64 V100 16 GB), one fresh process per plan.

Per (row, method): the search (planning) wall time, the planner's predicted step time, the
simulated step time and TFLOP/s per GPU (`meshplan.sim.simulate`; recomputation counted as
Megatron-LM counts it), and the lower bound ``bound_s = 3 F / (N · peak)``: F the forward FLOPs
of one global batch (the figure the simulator counts), N the GPUs, peak the V100's dense peak
at the plan's dtype. Methods: GPT auto, megatron-grid, inter-only, intra-only; MoE auto,
expert, inter-only, intra-only; Wide-ResNet auto, inter-only, intra-only. Memory budget: the
device's memory (plan()'s default); plans that do not fit are "infeasible".

The pipeline searches ("auto", "inter-only") run over L clustered layers, L = `NUM_LAYERS` per
suite; the planner's default everywhere (`default_num_layers`: one layer per repeated block of
GPT and MoE where devices allow), because on this planner a smaller L is slower, not faster:
the layers grow and their ILPs with them (2 cores, measured: GPT-39B auto L=16 118 s, L=24 56 s,
L=48 default 67 s; Wide-ResNet-13B L=18 255 s, L=35 default 125 s; MoE-70B L=8 over 900 s,
L=16 default 412 s), and a larger one splits the repeated blocks and finds worse pipelines
(MoE-70B L=32: 97 s but an estimated step of 43 s against 16 s). The other methods keep the
planner's own L (Megatron's grid: one layer per block; single-stage methods have none).
TFLOP/s per GPU are `Simulation.tflops_per_device`, which counts a fourth pass for the stages
that recompute (results/weak_scaling_2026-11-25.json was recorded before that: it counts one
for every stage of a pipeline where any stage recomputes).

Usage:
  python benchmarks/weak_scaling.py [--suite gpt|moe|wresnet ...] [--row NAME ...]
                                    [--method NAME ...] [--json PATH] [--timeout 600]
                                    [--table-only] [--plot PATH] [--num-layers L] [--jobs J]
Results are merged into the JSON file by (row, method), so suites can be run one at a time;
``--table-only`` prints the table (and ``--plot`` draws the figure) from that file without
planning. ``--num-layers`` overrides L for every pipeline search (to measure its cost).

``--jobs J`` (default 1) plans J rows at once, each child on one core (``MESHPLAN_WORKERS=1``:
the stage profiler's forked workers are off), so a plan's ``search_s`` is its search on one
core, not on the machine's; records and the run note carry ``jobs``. The plans start longest
first by the ``--json`` file's earlier wall times (`longest_first`). With the default each
child may fork a worker per core (prefetching stage costs), and ``search_s`` is the search on
the whole machine. The two are not comparable: a one-core search of a pipeline row is slower,
but J of them share the wall time. Single-stage searches whose refinement has a wall-clock
limit (`api._refine`, e.g. MoE-70B intra-only) may end differently when the cores are shared.
Measured with J=2 on 2 cores: 6 Wide-ResNet plans (1-2 GPUs) 31 s against 50 s one at a
time, MoE-1.3B's 4 plans 88 s against 145 s, same plans; but MoE-70B auto on one core passed
the default 600 s timeout (326 s on both cores), so give J > 1 a larger ``--timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_quality as pq  # noqa: E402  (the suites' rows, clusters and optimizers)

SUITES = ("gpt", "moe", "wresnet")
METHODS = {
    "gpt": ("auto", "megatron-grid", "inter-only", "intra-only"),
    "moe": ("auto", "expert", "inter-only", "intra-only"),
    "wresnet": ("auto", "inter-only", "intra-only"),
}
# The methods whose pipeline search runs over L clustered layers (Megatron's grid needs L to
# be a multiple of its pipeline sizes, so it keeps its own: one layer per repeated block).
LAYER_SEARCHES = ("auto", "inter-only")
# L per suite (None: the planner's default, `default_num_layers`): see the module docstring.
NUM_LAYERS: dict[str, int | None] = {"gpt": None, "moe": None, "wresnet": None}
DEFAULT_TIMEOUT_S = 600.0   # no plan measured took over 420 s
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "weak_scaling.json")
ROWS = {name: row for name, row in pq.ROWS.items() if row.suite in SUITES}
# Reduced-depth versions of the rows (``--reduced``; issue 27.3's check in CI,
# tests/test_auto_vs_baselines.py): each row's widths, cluster and dtype with two layers
# (Wide-ResNet: 26, its shallowest) and a small batch, so that every method plans in seconds.
REDUCED = {"gpt": "layers=2,batch=16", "moe": "layers=2,batch=16",
           "wresnet": "layers=26,batch=32"}


def reduced(row: pq.Row) -> pq.Row:
    """``row`` at reduced depth and batch (`REDUCED`), named ``<row>-reduced``."""
    kept = [field for field in row.spec.split(",") if not field.startswith("batch=")]
    return dataclasses.replace(row, name=f"{row.name}-reduced",
                               spec=",".join(kept + [REDUCED[row.suite]]))


REDUCED_ROWS = {r.name: r for r in map(reduced, ROWS.values())}
ALL_ROWS = {**ROWS, **REDUCED_ROWS}

_ONE_PLAN = """
import json, sys, time, traceback, warnings
warnings.simplefilter("ignore")
import meshplan.api as api
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.precision import DTYPES
from meshplan.errors import InfeasiblePlanError, NoPipelineError
from meshplan.runtime.optim import OptimizerSpec
from meshplan.sim.simulate import recomputed_stages, simulate
from meshplan.sim.task_costs import stage_plans
from meshplan.zoo.spec import build_workload
spec, cluster, method, dtype, optimizer, layers = sys.argv[1:7]
cl = parse_cluster_spec(cluster)
out = {"device_gib": cl.device.memory_bytes / 2**30}
w = build_workload(spec)
opt = OptimizerSpec.from_dict(json.loads(optimizer))
t0 = time.perf_counter()
try:
    p = api.plan(w.model, w.loss_fn, opt, w.example_batch, cluster, method=method, dtype=dtype,
                 name=spec, num_layers=None if layers == "-" else int(layers))
except (InfeasiblePlanError, NoPipelineError) as e:
    out.update(status="infeasible", error=f"{type(e).__name__}: {e}")
except Exception as e:
    out.update(status="error", error=f"{type(e).__name__}: {e}",
               traceback=traceback.format_exc()[-3000:])
out["search_s"] = time.perf_counter() - t0
# The clock has stopped: simulating and bounding are not the search.
if out.get("status") is None:
    try:
        sim = simulate(p)
        n, peak = cl.num_devices, cl.device.peak(DTYPES[p.dtype])
        flops = sum(s.predicted["forward_flops"] for s in stage_plans(p)) * p.microbatches
        passes = [4 if rc else 3 for rc in recomputed_stages(p)]
        counted = sum(k * s.predicted["forward_flops"] for k, s in zip(passes, stage_plans(p))) \
            * p.microbatches / (sim.step_time_s * n) / 1e12   # simulate()'s own figure
        out.update(
            status="ok", planner_step_s=p.predicted["step_time_s"], step_s=sim.step_time_s,
            tflops=sim.tflops_per_device, mfu=sim.mfu, bubble=sim.bubble_fraction,
            sim_peak_gib=max(sim.peak_memory_bytes) / 2**30,
            planner_peak_gib=p.predicted["peak_memory_bytes"] / 2**30,
            forward_flops=flops, passes=passes, peak_flops=peak,
            bound_s=3 * flops / (n * peak),
            flops_check=counted / sim.tflops_per_device if sim.tflops_per_device else None,
            microbatches=p.microbatches, dtype=p.dtype, recompute=p.recompute,
            num_layers=p.num_layers, schedule=p.schedule, chunks=p.chunks,
            megatron=p.options.get("megatron"), search_stats=p.ilp,
            stages=[{"layers": s.layers, "submesh": s.submesh, "mesh": s.mesh_shape,
                     "recompute": s.recompute, "latency_s": s.latency_s,
                     "memory_gib": s.memory_bytes / 2**30} for s in p.stages])
    except Exception as e:
        out.update(status="error", error=f"simulation: {type(e).__name__}: {e}",
                   traceback=traceback.format_exc()[-3000:])
print(json.dumps(out, default=str))
"""


def num_layers_for(row: pq.Row, method: str, override: int | None = None) -> int | None:
    """L given to plan(): the override or the suite's setting for the pipeline searches, None
    (the planner's own) otherwise and on one GPU, where no pipeline is searched."""
    if method not in LAYER_SEARCHES or row.gpus == 1:
        return None
    return override if override is not None else NUM_LAYERS[row.suite]


def run_plan(row: pq.Row, method: str, layers: int | None, timeout_s: float) -> dict:
    """Plan and simulate ``row`` with ``method`` in a fresh process (`plan_quality.run_child`);
    ``wall_s`` is the child's whole life (simulation included; not the imports, which its
    fork server made once)."""
    return pq.run_child([_ONE_PLAN, row.spec, row.cluster, method, row.dtype,
                         json.dumps(row.optimizer), "-" if layers is None else str(layers)],
                        timeout_s)


def planned(tasks: list[tuple[str, str, int | None]], timeout_s: float, jobs: int
            ) -> Iterator[tuple[str, str, int | None, dict]]:
    """``(name, method, layers, record)`` of each task ``(name, method, layers)``, in the
    tasks' order, with ``jobs`` children running at a time."""
    if jobs == 1:
        for name, method, layers in tasks:
            yield name, method, layers, run_plan(ALL_ROWS[name], method, layers, timeout_s)
        return
    with ThreadPoolExecutor(jobs) as pool:   # threads only wait on their child processes
        futures = [pool.submit(run_plan, ALL_ROWS[name], method, layers, timeout_s)
                   for name, method, layers in tasks]
        for (name, method, layers), future in zip(tasks, futures):
            yield name, method, layers, future.result()


def longest_first(tasks: list[tuple[str, str, int | None]], earlier: dict[str, dict]
                  ) -> list[tuple[str, str, int | None]]:
    """``tasks`` by their earlier record's ``wall_s``, longest (or never run) first: with
    several children at a time the run then does not end waiting on one long plan."""
    def wall(task: tuple[str, str, int | None]) -> float:
        r = earlier.get(f"{task[0]}/{task[1]}")
        return r["wall_s"] if r and "wall_s" in r else float("inf")
    return sorted(tasks, key=wall, reverse=True)


def load_results(path: str | None) -> tuple[dict[str, dict], dict]:
    """Earlier results keyed "row/method" and the file's run notes ({} without a file)."""
    if not path or not os.path.exists(path):
        return {}, {}
    with open(path) as f:
        data = json.load(f)
    return {f"{r['row']}/{r['method']}": r for r in data["results"]}, data.get("runs", {})


def save_results(path: str | None, results: dict[str, dict], runs: dict) -> None:
    """Write every record, in suite order then the methods' order."""
    if not path:
        return
    order = {name: i for i, name in enumerate(ROWS)}
    rank = {m: i for ms in METHODS.values() for i, m in enumerate(ms)}
    records = sorted(results.values(), key=lambda r: (order.get(r["row"], 1e9),
                                                      rank.get(r["method"], 99)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": f"{platform.machine()}, Python {platform.python_version()}, "
                              f"{os.cpu_count()} cores",
                   "num_layers": NUM_LAYERS, "runs": runs, "results": records}, f, indent=1)


def stages_text(r: dict) -> str:
    """E.g. "3 stages: 2 × (1,8)→(2,4) + …, L=24, B=64": the stage count, runs of equal
    stages (plan_quality's summary) and the micro-batches."""
    if r.get("megatron"):
        m = r["megatron"]
        plan = f"dp={m['dp']} tp={m['tp']} pp={m['pp']} mb={m['mb']}"
        if m.get("virtual", 1) > 1:
            plan += f" v={m['virtual']}"
        return f"{plan}, B={r['microbatches']}"
    n = len(r["stages"])
    chunks = f" ({r['chunks']} chunks/mesh)" if r.get("chunks", 1) > 1 else ""
    return (f"{n} stage{'s' * (n > 1)}{chunks}: {pq.stages_text(r)}, B={r['microbatches']}"
            + (" rc" if r.get("recompute") and n == 1 else ""))


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "–" if x is None else format(x, fmt)


def row_cells(r: dict) -> list[str]:
    """The table's cells of one (row, method) record."""
    row = ALL_ROWS[r["row"]]
    layers = r.get("num_layers_arg")
    cells = [r["row"], str(row.gpus), r["method"], r["status"],
             "default" if layers is None else str(layers), _num(r.get("search_s"), ".1f")]
    if r["status"] != "ok":
        note = r.get("error", "").split("\n")[0][:80]
        return cells + ["–"] * 7 + [note]
    peak = _num(r.get("sim_peak_gib"), ".2f") + (" **over**" if over_memory(r) else "")
    return cells + [_num(r["planner_step_s"]), _num(r["step_s"]), _num(r["tflops"], ".2f"),
                    _num(r["bound_s"]), _num(r["step_s"] / r["bound_s"], ".2f"), peak,
                    stages_text(r)]


def over_memory(r: dict) -> bool:
    """Whether a plan's simulated peak exceeds the device's memory: it would not run, so it
    is no baseline to beat (the planner fits by its own model, the simulator walks the step
    op by op)."""
    return r["status"] == "ok" and r.get("sim_peak_gib") is not None and \
        r["sim_peak_gib"] > r["device_gib"]


def auto_against_baselines(results: dict[str, dict], names: list[str]) -> None:
    """Per row: auto's simulated step against the fastest baseline whose plan fits the device
    as simulated, and on how many rows auto fits and is within 0.5 % of it or ahead (issue
    27.3)."""
    print("\n| row | auto s | auto fits | best baseline that fits | its s | auto / it |")
    print("|---|---:|---|---|---:|---:|")
    held = rows = 0
    for name in names:
        auto = results.get(f"{name}/auto")
        others = [results.get(f"{name}/{m}") for m in METHODS[ALL_ROWS[name].suite]
                  if m != "auto"]
        fitting = [r for r in others if r and r["status"] == "ok" and not over_memory(r)]
        if auto is None or auto["status"] != "ok":
            continue
        best = min(fitting, key=lambda r: r["step_s"], default=None)
        ratio = auto["step_s"] / best["step_s"] if best else None
        rows += 1
        held += not over_memory(auto) and (ratio is None or ratio <= 1.005)
        print(f"| {name} | {auto['step_s']:.4g} | {'no' if over_memory(auto) else 'yes'} | "
              f"{best['method'] if best else '–'} | {_num(best and best['step_s'])} | "
              f"{_num(ratio, '.3f')} |")
    print(f"\nauto fits and is within 0.5 % of the fastest fitting baseline or ahead: {held} of "
          f"{rows} rows")


def print_table(results: dict[str, dict], names: list[str]) -> None:
    print("| row | GPUs | method | status | L arg | search s | planner step s | "
          "simulated step s | sim TFLOP/s/GPU | bound s | sim / bound | sim peak GiB | "
          "stages |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in names:
        for method in METHODS[ALL_ROWS[name].suite]:
            r = results.get(f"{name}/{method}")
            if r is not None:
                print("| " + " | ".join(row_cells(r)) + " |")


def plot(results: dict[str, dict], path: str) -> None:
    """Alpa's Fig. 7 layout: per suite, aggregate simulated PFLOP/s against GPUs (log2), one
    line per method, the bound's throughput (3F / bound_s, i.e. every GPU at peak) as the
    ideal; where a method has no plan (infeasible, timeout, error) an x at the panel's bottom,
    one level per method, so a missing point is seen rather than silently left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"gpt": "GPT", "moe": "MoE", "wresnet": "Wide-ResNet"}
    styles = {"auto": ("C0", "o"), "megatron-grid": ("C1", "s"), "expert": ("C1", "s"),
              "inter-only": ("C2", "^"), "intra-only": ("C3", "v")}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, suite in zip(axes, SUITES):
        rows = [r for r in ROWS.values() if r.suite == suite]
        bound = [(r.gpus, _bound_pflops(results, r.name)) for r in rows]
        bound = [(g, b) for g, b in bound if b is not None]
        if bound:
            ax.plot(*zip(*bound), "k--", lw=1, marker=".", label="lower bound (all GPUs at peak)")
        for k, method in enumerate(METHODS[suite]):
            color, marker = styles[method]
            pts, missing = [], {}
            for r in rows:
                rec = results.get(f"{r.name}/{method}")
                if rec is None:
                    continue
                if rec["status"] == "ok":
                    pts.append((r.gpus, rec["tflops"] * r.gpus / 1000))
                else:
                    missing.setdefault(rec["status"], []).append(r.gpus)
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=method)
            for status, gpus in missing.items():
                # x in data, y in axes coordinates: the bottom whatever the data's range.
                ax.plot(gpus, [0.03 + 0.035 * k] * len(gpus), color=color, marker="x", ms=9,
                        mew=2, ls="none", transform=ax.get_xaxis_transform(),
                        label=f"{method}: {status}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(0.8, 80)
        ax.set_xticks([r.gpus for r in rows])
        ax.set_xticklabels([str(r.gpus) for r in rows])
        ax.set_title(f"{titles[suite]} (p3.16xlarge, V100 16 GB)")
        ax.set_xlabel("GPUs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("simulated aggregate throughput, PFLOP/s")
    fig.suptitle("Weak scaling, simulated (meshplan.sim): Alpa Fig. 7's models and baselines "
                 "(FLOPs with recomputation counted, as Alpa and Megatron-LM count them)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def _bound_pflops(results: dict[str, dict], name: str) -> float | None:
    """3F / bound_s of a row (N × peak), from any of its plans (F is the model's, not the
    plan's; the dtype is the row's)."""
    for method in METHODS[ALL_ROWS[name].suite]:
        r = results.get(f"{name}/{method}")
        if r and r["status"] == "ok":
            return 3 * r["forward_flops"] / r["bound_s"] / 1e15
    return None


def git_commit() -> str | None:
    """The checkout's commit, "+dirty" when meshplan/ has uncommitted changes: the planner
    may change under a long run (record it at both ends)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "meshplan"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def selected_rows(suites: list[str] | None, names: list[str] | None) -> list[str]:
    if names:
        return names
    return [n for n, r in ROWS.items() if suites is None or r.suite in suites]


def progress_line(t_start: float, name: str, method: str, r: dict) -> str:
    """One finished plan, with the elapsed time of the whole run."""
    head = (f"[{time.perf_counter() - t_start:7.1f} s] {name} {method} "
            f"L={r.get('num_layers_arg') or 'default'}: {r['status']}, search "
            f"{r.get('search_s', float('nan')):.1f} s (process {r['wall_s']:.1f} s)")
    if r["status"] == "ok":
        return (head + f", step planner {r['planner_step_s']:.4g} s sim {r['step_s']:.4g} s, "
                f"{r['tflops']:.1f} TFLOP/s/GPU, bound {r['bound_s']:.4g} s, "
                f"{len(r['stages'])} stages, L={r['num_layers']}, B={r['microbatches']}")
    return head + ": " + r.get("error", "").split("\n")[0][:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="append", choices=SUITES)
    ap.add_argument("--row", action="append", choices=list(ALL_ROWS))
    ap.add_argument("--reduced", action="store_true",
                    help="plan the rows' reduced-depth versions (REDUCED) instead")
    ap.add_argument("--method", action="append",
                    help="plan only these of a row's methods (default: all of them)")
    ap.add_argument("--json", default=DEFAULT_JSON,
                    help=f"merge raw results into this file (default {DEFAULT_JSON})")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per plan")
    ap.add_argument("--table-only", action="store_true", help="print the table from --json")
    ap.add_argument("--plot", metavar="PATH", help="draw the figure (PNG) from the results")
    ap.add_argument("--num-layers", type=int, help="L of every pipeline search (measuring)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="plans at once, each on one core (see the module docstring)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    names = selected_rows(args.suite, args.row)
    if args.reduced:
        names = [n if n in REDUCED_ROWS else f"{n}-reduced" for n in names]
    results, runs = load_results(args.json)
    if not args.table_only:
        t_start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
        commit = git_commit()
        if args.jobs > 1:
            os.environ["MESHPLAN_WORKERS"] = "1"   # inherited by the children: one core each
        tasks = [(name, method, num_layers_for(ALL_ROWS[name], method, args.num_layers))
                 for name in names for method in METHODS[ALL_ROWS[name].suite]
                 if not args.method or method in args.method]
        if args.jobs > 1:
            tasks = longest_first(tasks, results)
        for name, method, layers, r in planned(tasks, args.timeout, args.jobs):
            row = ALL_ROWS[name]
            r = {"row": name, "method": method, "gpus": row.gpus, "cluster": row.cluster,
                 "num_layers_arg": layers, "timeout_s": args.timeout, "jobs": args.jobs,
                 "commit": git_commit(), **r}
            results[f"{name}/{method}"] = r
            save_results(args.json, results, runs)
            print(progress_line(t_start, name, method, r), file=sys.stderr, flush=True)
        total = time.perf_counter() - t_start
        runs[started] = {"argv": sys.argv[1:] if argv is None else argv, "rows": names,
                         "commit": commit, "commit_at_end": git_commit(),
                         "total_wall_s": total, "jobs": args.jobs}
        save_results(args.json, results, runs)
        print(f"total wall time {total:.0f} s ({total / 60:.1f} min)", file=sys.stderr,
              flush=True)
    print_table(results, names)
    auto_against_baselines(results, names)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
