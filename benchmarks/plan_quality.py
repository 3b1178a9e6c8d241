"""Plan feasibility and plan quality (issue 7's acceptance), one fresh process per plan.

Alpa's GPT, MoE and Wide-ResNet suites on p3.16xlarge (1-64 V100 16 GB) and Megatron-LM's
Table 1 rows on dgx-a100 (32-3072 A100 80 GB), each planned with method "auto" and, where the
acceptance compares, a baseline by the same cost model: "megatron-grid" on every GPT row,
"equal-operator" on Wide-ResNet 16 and 32 GPUs, "expert" on MoE 16 and 32 GPUs. Memory budget:
the device's memory (plan()'s default).

Usage:
  python benchmarks/plan_quality.py [--suite gpt|moe|wresnet|megatron ...] [--row NAME ...]
                                    [--method NAME ...] [--json PATH] [--timeout 900]
                                    [--table-only]
Results are merged into the JSON file by (row, method), so suites can be run one at a time;
``--table-only`` prints the table from that file without planning.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Alpa's suites: (preset, GPUs); clusters p3.16xlarge (perf_tables.md §2).
ALPA_SUITES = {
    "gpt": [("350m", 1), ("760m", 2), ("1.3b", 4), ("2.6b", 8), ("6.7b", 16), ("15b", 32),
            ("39b", 64)],
    "moe": [("380m", 1), ("690m", 2), ("1.3b", 4), ("2.4b", 8), ("10b", 16), ("27b", 32),
            ("70b", 64)],
    "wresnet": [("250m", 1), ("500m", 2), ("1b", 4), ("2b", 8), ("4b", 16), ("6.8b", 32),
                ("13b", 64)],
}
# The optimizer of each suite, as Alpa's benchmark scripts train them (benchmark/alpa/
# benchmark_one_case_*.py): AdamW for GPT, Adafactor for MoE, SGD with Nesterov momentum 0.9 for
# Wide-ResNet; Megatron-LM trains with Adam.
OPTIMIZERS = {
    "gpt": {"kind": "adamw", "lr": 1e-2},
    "moe": {"kind": "adafactor", "lr": 1e-2},
    "wresnet": {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    "megatron": {"kind": "adam", "lr": 1e-4},
}
# Megatron-LM Table 1 (perf_tables.md §1): (preset, GPUs, global batch), on DGX A100 hosts.
MEGATRON_ROWS = [("1.7b", 32, 512), ("7.5b", 128, 512), ("39.1b", 512, 1536),
                 ("145.6b", 1536, 2304), ("1t", 3072, 3072)]
# The acceptance's baselines: suite -> (method, GPU counts it is compared on, minimum ratio
# baseline / auto). GPT: auto <= megatron-grid on every row, i.e. ratio >= 1.
BASELINES = {
    "gpt": ("megatron-grid", None, 1.0),
    "moe": ("expert", (16, 32), 2.0),
    "wresnet": ("equal-operator", (16, 32), 1.5),
}


@dataclass(frozen=True)
class Row:
    """One model row of a suite: its zoo spec, cluster spec, dtype and the methods planned."""

    name: str
    suite: str
    gpus: int
    spec: str
    cluster: str
    dtype: str
    methods: tuple[str, ...]

    @property
    def optimizer(self) -> dict:
        return OPTIMIZERS[self.suite]


def p3_cluster(gpus: int) -> str:
    """Alpa's testbed: up to 8 V100s of one p3.16xlarge, then whole hosts."""
    return f"p3.16xlarge:1x{gpus}" if gpus < 8 else f"p3.16xlarge:{gpus // 8}"


def build_rows() -> dict[str, Row]:
    """Every row of the four suites, in suite order, smallest first."""
    rows: dict[str, Row] = {}
    for suite, entries in ALPA_SUITES.items():
        batch, dtype = (1536, "fp32") if suite == "wresnet" else (1024, "fp16")
        method, on_gpus, _ = BASELINES[suite]
        for preset, gpus in entries:
            methods = ("auto", method) if on_gpus is None or gpus in on_gpus else ("auto",)
            name = f"{suite}-{preset}"
            rows[name] = Row(name, suite, gpus, f"{suite}:preset={preset},batch={batch}",
                             p3_cluster(gpus), dtype, methods)
    for preset, gpus, batch in MEGATRON_ROWS:
        name = f"megatron-{preset}"
        # Megatron trained in fp16 mixed precision (the paper's setting).
        rows[name] = Row(name, "megatron", gpus, f"gpt:preset={preset},batch={batch}",
                         f"dgx-a100:{gpus // 8}", "fp16", ("auto",))
    return rows


ROWS = build_rows()

_ONE_PLAN = """
import json, sys, time, traceback, warnings
warnings.simplefilter("ignore")
import meshplan.api as api
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.errors import InfeasiblePlanError, NoPipelineError
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload
spec, cluster, method, dtype, optimizer, limit, bound = sys.argv[1:8]
device_bytes = parse_cluster_spec(cluster).device.memory_bytes
# "none": no memory limit (a baseline's speed where it has no plan within the device)
budget = {"memory_budget_gb": 0} if limit == "none" else {}
out = {"device_gib": device_bytes / 2**30}
t0 = time.perf_counter()
try:
    w = build_workload(spec)
    opt = OptimizerSpec.from_dict(json.loads(optimizer))
    p = api.plan(w.model, w.loss_fn, opt, w.example_batch, cluster, method=method,
                 dtype=dtype, name=spec, **budget)
except (InfeasiblePlanError, NoPipelineError) as e:
    out.update(status="infeasible", error=f"{type(e).__name__}: {e}")
except Exception as e:
    out.update(status="error", error=f"{type(e).__name__}: {e}",
               traceback=traceback.format_exc()[-3000:])
else:
    peak = p.predicted["peak_memory_bytes"]
    out.update(status="ok", feasible=peak <= device_bytes, step_s=p.predicted["step_time_s"],
               memory_gib=peak / 2**30, microbatches=p.microbatches, dtype=p.dtype,
               num_layers=p.num_layers, schedule=p.schedule,
               megatron=p.options.get("megatron"), ilp=p.ilp,
               stages=[{"layers": s.layers, "submesh": s.submesh, "mesh": s.mesh_shape,
                        "recompute": s.recompute, "latency_s": s.latency_s,
                        "memory_gib": s.memory_bytes / 2**30} for s in p.stages])
out["wall_s"] = time.perf_counter() - t0
# After the wall time: planning never traces the whole batch.
if bound == "bound" and out["status"] == "ok":
    from meshplan.capture.to_ir import capture
    from meshplan.cost.bounds import compute_bound_s
    from meshplan.cost.precision import with_compute_dtype
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    out["compute_bound_s"] = compute_bound_s(with_compute_dtype(graph, dtype),
                                             parse_cluster_spec(cluster))
print(json.dumps(out, default=str))
"""


NO_LIMIT = " (no memory limit)"   # suffix of a baseline re-planned without the device limit


def run_plan(row: Row, method: str, timeout_s: float) -> dict:
    """Plan ``row`` with ``method`` in a fresh process (`run_child`)."""
    base = method.removesuffix(NO_LIMIT)
    return run_child([_ONE_PLAN, row.spec, row.cluster, base, row.dtype,
                      json.dumps(row.optimizer), "none" if base != method else "device",
                      "bound" if method == _baseline(row) else "-"], timeout_s)


# Modules every plan's child imports, imported once by the process its children fork from
# (`run_child`): torch and the planner take 1.7 s to import, and a suite starts 77 children.
PRELOAD = ["meshplan.api", "meshplan.sim.simulate", "meshplan.zoo.spec",
           "meshplan.runtime.optim", "meshplan.cost.precision"]


def run_child(args: list[str], timeout_s: float) -> dict:
    """The script ``args[0]`` run with ``sys.argv[1:] = args[1:]`` in a fresh process (its own
    session, so a timeout ends the planner's forked workers too), as ``python -c *args``
    would, but forked from a server that has imported `PRELOAD` once (multiprocessing's
    forkserver: a clean process, single-threaded, with nothing of this one in it; where the
    platform has none, ``python -c``): the JSON record on its last stdout line, or a timeout
    / crash record; ``wall_s`` is added when the child does not give one. The child sees
    this process's environment as it is at the call."""
    t0 = time.perf_counter()
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return _run_python(args, timeout_s, t0)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = ctx.Process(target=_run_script, args=(args, dict(os.environ), out, err))
        proc.start()
        proc.join(timeout_s)
        if proc.exitcode is None:
            _kill_session(proc.pid)
            proc.join()
            return {"status": "timeout", "error": f"no plan within {timeout_s:.0f} s",
                    "wall_s": time.perf_counter() - t0}
        _kill_session(proc.pid)   # a worker it left behind
        with open(out) as o, open(err) as e:
            return _record(proc.exitcode, o.read(), e.read(), t0)


def _run_script(args: list[str], environ: dict[str, str], out: str, err: str) -> None:
    """The forked child: a session of its own, the caller's environment, stdout and stderr
    into the files ``out`` and ``err``, then the script as ``python -c`` runs it (a fresh
    ``__main__`` namespace)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["-c", *args[1:]]
    exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    sys.stderr.flush()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_python(args: list[str], timeout_s: float, t0: float) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "timeout", "error": f"no plan within {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    return _record(proc.returncode, out, err, t0)


def _record(code: int, out: str, err: str, t0: float) -> dict:
    lines = out.strip().splitlines()
    if code != 0 or not lines:
        return {"status": "error", "wall_s": time.perf_counter() - t0,
                "error": f"exit code {code}: {err.strip()[-2000:]}"}
    return {"wall_s": time.perf_counter() - t0, **json.loads(lines[-1])}


def _baseline(row: Row) -> str | None:
    """The method ``row``'s auto plan is compared with, if any."""
    return row.methods[1] if len(row.methods) > 1 else None


def load_results(path: str | None) -> dict[str, dict]:
    """Earlier results keyed "row/method" ({} without a file)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return {f"{r['row']}/{r['method']}": r for r in json.load(f)["results"]}


def save_results(path: str | None, results: dict[str, dict]) -> None:
    if not path:
        return
    order = {name: i for i, name in enumerate(ROWS)}
    records = sorted(results.values(), key=lambda r: (order.get(r["row"], 1e9), r["method"]))
    with open(path, "w") as f:
        json.dump({"machine": f"{platform.machine()}, Python {platform.python_version()}, "
                              f"{os.cpu_count()} cores", "results": records}, f, indent=1)


def stages_text(r: dict) -> str:
    """E.g. "2 × (1,8)→(2,4) rc, L=24": runs of equal stages, clustered layer count."""
    groups: list[list] = []
    for s in r["stages"]:
        key = (tuple(s["submesh"]), tuple(s["mesh"]), s["recompute"])
        if groups and groups[-1][0] == key:
            groups[-1][1] += 1
        else:
            groups.append([key, 1])
    parts = [f"{n} × ({sub[0]},{sub[1]})→({m[0]},{m[1]}){' rc' if rc else ''}"
             for (sub, m, rc), n in groups]
    return " + ".join(parts) + f", L={r['num_layers']}"


def step_text(r: dict | None) -> str:
    if r is None:
        return "–"
    if r["status"] == "ok":
        return f"{r['step_s']:.4g}"
    return r["status"]


def fits_text(r: dict | None) -> str:
    if r is None:
        return "–"
    if r["status"] != "ok":
        return "no: " + r["status"]
    return f"{'yes' if r['feasible'] else 'NO'} ({r['memory_gib']:.2f}/{r['device_gib']:.0f})"


def criterion_text(row: Row, auto: dict | None, base: dict | None, results: dict[str, dict]
                   ) -> tuple[str, str]:
    """(baseline / auto ratio, whether the acceptance's bound holds) for one row."""
    if row.suite not in BASELINES or base is None:
        return "–", "–"
    if auto is None or auto["status"] != "ok":
        return "–", f"NO (auto: {auto['status'] if auto else 'not run'})"
    if base["status"] != "ok":  # auto has a plan where the baseline has none
        free = results.get(f"{row.name}/{row.methods[1]}{NO_LIMIT}")
        if free and free["status"] == "ok":
            ratio = free["step_s"] / auto["step_s"]
            return (f"{ratio:.3f} (without a memory limit)",
                    f"yes (baseline: {base['status']} in the device; {ratio:.1f}× slower "
                    "without a limit)")
        return "–", f"yes (baseline: {base['status']})"
    ratio = base["step_s"] / auto["step_s"]
    bound = BASELINES[row.suite][2]
    verdict = f"{'yes' if ratio >= bound else 'NO'} (≥ {bound:g})"
    floor = base.get("compute_bound_s")
    if ratio < bound and floor and base["step_s"] / floor < bound:
        # No plan is faster than the compute bound, so none is `bound` times the baseline's.
        verdict += (f"; unreachable: the baseline is {base['step_s'] / floor:.2f}× the "
                    f"compute bound {floor:.4g} s")
    return f"{ratio:.3f}", verdict


def plan_text(r: dict | None) -> str:
    """A baseline's plan: Megatron's (dp, tp, pp, micro-batch size), else its stages."""
    if r is None or r["status"] != "ok":
        return "–"
    m = r.get("megatron")
    if m:
        return f"dp={m['dp']} tp={m['tp']} pp={m['pp']} mb={m['mb']}, B={r['microbatches']}"
    return f"{stages_text(r)}, B={r['microbatches']}"


def row_cells(row: Row, results: dict[str, dict]) -> list[str]:
    """The table's cells of one row."""
    auto = results.get(f"{row.name}/auto")
    base_method = _baseline(row)
    base = results.get(f"{row.name}/{base_method}") if base_method else None
    ratio, ok = criterion_text(row, auto, base, results)
    planned = auto is not None and auto["status"] == "ok"
    return [row.name, str(row.gpus), row.cluster, row.dtype, step_text(auto),
            base_method or "–", step_text(base), ratio, ok,
            f"{auto['wall_s']:.0f}" if auto else "–",
            stages_text(auto) if planned else "–",
            str(auto["microbatches"]) if planned else "–",
            fits_text(auto), plan_text(base), fits_text(base)]


def print_table(results: dict[str, dict], names: list[str]) -> None:
    print("| row | GPUs | cluster | dtype | auto step s | baseline | baseline step s | "
          "baseline / auto | bound | auto search s | auto stages | B | auto fits (GiB) | "
          "baseline plan | baseline fits (GiB) |")
    print("|---|---:|---|---|---:|---|---:|---:|---|---:|---|---:|---|---|---|")
    for name in names:
        print("| " + " | ".join(row_cells(ROWS[name], results)) + " |")


def selected_rows(suites: list[str] | None, names: list[str] | None) -> list[str]:
    if names:
        return names
    return [n for n, r in ROWS.items() if suites is None or r.suite in suites]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="append", choices=("gpt", "moe", "wresnet", "megatron"))
    ap.add_argument("--row", action="append", choices=list(ROWS))
    ap.add_argument("--method", action="append",
                    help="plan only these of a row's methods (default: all of them)")
    ap.add_argument("--json", help="merge raw results into this file (read it for the table)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per plan")
    ap.add_argument("--table-only", action="store_true", help="print the table from --json")
    args = ap.parse_args(argv)
    names = selected_rows(args.suite, args.row)
    results = load_results(args.json)
    if not args.table_only:
        for name in names:
            for method in ROWS[name].methods:
                if args.method and method not in args.method:
                    continue
                todo = [method]
                while todo:
                    m = todo.pop()
                    r = run_plan(ROWS[name], m, args.timeout)
                    results[f"{name}/{m}"] = {"row": name, "method": m, **r}
                    save_results(args.json, results)
                    print(f"{name} {m}: {r['status']} in {r['wall_s']:.1f} s "
                          f"{r.get('step_s', r.get('error', ''))}", file=sys.stderr, flush=True)
                    # A baseline with no plan in the device: how fast it would be with more
                    # memory bounds what it could ever reach.
                    if m != "auto" and not m.endswith(NO_LIMIT) and r["status"] == "infeasible":
                        todo.append(m + NO_LIMIT)
    print_table(results, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
