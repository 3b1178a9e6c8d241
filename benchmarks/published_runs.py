"""Simulated against published: the plans of published runs, simulated, next to their measured
throughput (`../shared/reference/perf_tables.md`).

Megatron-LM's Table 1 rows on DGX A100 (§1) and the Megatron-LM plans of Alpa's GPT rows on
p3.16xlarge (§2), each planned with its published configuration (method
``megatron:dp=…,tp=…,pp=…,mb=…[,virtual=…]``, fp16, full recomputation, Adam) and the
attention those runs used (scores materialized: ``flash=0``), then simulated
(`meshplan.sim.simulate`). TFLOP/s per GPU are counted as the publications count them
(recomputation included). Each row is planned within its device's memory, recomputed layer by
layer as Megatron-LM's full recomputation is; ``peak GiB`` is the simulated peak per device.

With ``--auto`` (issue 27.5), each row is also planned by ``auto`` on the same model, cluster,
batch and dtype (its own recomputation, ZeRO, stages and micro-batches), in a fresh process
with ``--timeout`` seconds, and both plans' simulated steps are listed side by side.

Usage: python benchmarks/published_runs.py [--row NAME ...] [--json PATH]
       [--auto [--timeout S] [--jobs N]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed

# name: (preset, cluster, dp, tp, pp, global batch, micro-batch size, virtual, published TF/s)
ROWS = {
    # Megatron-LM Table 1 (SC'21), 80 GB A100s, 8 per DGX host.
    "megatron-1.7b": ("1.7b", "dgx-a100:4", 32, 1, 1, 512, 16, 1, 137.0),
    "megatron-7.5b": ("7.5b", "dgx-a100:16", 32, 4, 1, 512, 16, 1, 142.0),
    "megatron-39.1b": ("39.1b", "dgx-a100:64", 32, 8, 2, 1536, 4, 1, 138.0),
    "megatron-145.6b": ("145.6b", "dgx-a100:192", 24, 8, 8, 2304, 2, 2, 148.0),
    "megatron-1t": ("1t", "dgx-a100:384", 6, 8, 64, 3072, 1, 1, 163.0),
    # Alpa's artifact: Megatron-LM's plans for its GPT rows on V100 (seq 1024).
    "alpa-350m-1": ("350m", "p3.16xlarge:1x1", 1, 1, 1, 128, 16, 1, 47.53),
    "alpa-1.3b-4": ("1.3b", "p3.16xlarge:1x4", 2, 1, 2, 1024, 4, 1, 55.89),
    "alpa-2.6b-8": ("2.6b", "p3.16xlarge:1x8", 1, 1, 8, 1024, 8, 1, 50.44),
    "alpa-6.7b-16": ("6.7b", "p3.16xlarge:2x8", 1, 2, 8, 1024, 4, 1, 56.59),
    "alpa-15b-32": ("15b", "p3.16xlarge:4x8", 1, 4, 8, 1024, 4, 1, 58.24),
}


def workload_spec(name: str) -> str:
    """The zoo spec of row ``name``'s model: the preset, the global batch, scores
    materialized."""
    preset, batch = ROWS[name][0], ROWS[name][5]
    return f"gpt:preset={preset},batch={batch},flash=0"


def gpus(name: str) -> int:
    """The GPUs of row ``name``'s published plan: dp × tp × pp."""
    return ROWS[name][2] * ROWS[name][3] * ROWS[name][4]


def _bench(module: str):
    """A sibling benchmark module (`plan_quality`, `weak_scaling`), imported."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return __import__(module)


def run_row(name: str, device: object = None) -> dict:
    """Plan and simulate one row; ``device`` (a `DeviceType`) replaces the preset cluster's
    device type (what `calibrate_devices.py` varies)."""
    import dataclasses

    import meshplan.api as api
    from meshplan.cost.cluster import parse_cluster_spec
    from meshplan.sim.simulate import simulate
    from meshplan.zoo.spec import build_workload
    preset, spec, dp, tp, pp, batch, mb, virtual, published = ROWS[name]
    cluster = parse_cluster_spec(spec)
    if device is not None:
        cluster = dataclasses.replace(cluster, device=device)
    w = build_workload(workload_spec(name), device="meta")
    method = f"megatron:dp={dp},tp={tp},pp={pp},mb={mb}" + (f",virtual={virtual}"
                                                          if virtual > 1 else "")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = api.plan(w.model, w.loss_fn, "adam", w.example_batch, cluster, method=method,
                        dtype="fp16", recompute="full")
    planned = time.perf_counter() - t0
    sim = simulate(plan)
    return {"row": name, "method": method, "cluster": spec, "plan_s": planned,
            "microbatches": plan.microbatches, "planner_step_s": plan.predicted["step_time_s"],
            "step_s": sim.step_time_s, "tflops": sim.tflops_per_device,
            "published_tflops": published, "ratio": sim.tflops_per_device / published,
            "bubble": sim.bubble_fraction, "mfu": sim.mfu,
            "peak_gib": max(sim.peak_memory_bytes) / 2**30,
            "device_gib": cluster.device.memory_bytes / 2**30}


def run_auto(name: str, timeout_s: float) -> dict:
    """Row ``name`` planned by ``auto`` (Adam, fp16, the planner's own recomputation and
    layers) and simulated, in a fresh process (`weak_scaling._ONE_PLAN`): its record, or a
    timeout / error record."""
    script = _bench("weak_scaling")._ONE_PLAN
    return _bench("plan_quality").run_child(
        [script, workload_spec(name), ROWS[name][1], "auto", "fp16",
         json.dumps({"kind": "adam"}), "-"], timeout_s)


def auto_table(records: list[dict], autos: dict[str, dict]) -> list[str]:
    """The published plan and auto's, each simulated, side by side (markdown rows)."""
    ws = _bench("weak_scaling")
    lines = ["| row | GPUs | published plan | its simulated step s | auto's plan | auto simulated "
             "step s | published / auto | auto peak GiB | auto search s |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in records:
        a = autos[r["row"]]
        head = f"| {r['row']} | {gpus(r['row'])} | {r['method']}, B={r['microbatches']} | {r['step_s']:.3f} | "
        if a.get("status") != "ok":
            lines.append(head + f"{a.get('status')}: {a.get('error', '')[:120]} | – | – | – | "
                         f"{a.get('search_s', a.get('wall_s', 0)):.0f} |")
            continue
        lines.append(head + f"{ws.stages_text(a)} | {a['step_s']:.3f} | "
                     f"{r['step_s'] / a['step_s']:.3f} | {a['sim_peak_gib']:.1f} of "
                     f"{a['device_gib']:.0f} | {a['search_s']:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", action="append", choices=sorted(ROWS))
    ap.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    ap.add_argument("--auto", action="store_true",
                    help="also plan each row with auto and list both plans side by side")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds for each auto plan (with --auto)")
    ap.add_argument("--jobs", type=int, default=1, help="auto plans at once (with --auto)")
    args = ap.parse_args()
    rows = args.row or list(ROWS)
    print(f"python {platform.python_version()}, {len(rows)} rows", flush=True)
    print("| row | plan | B | planner step s | simulated step s | simulated TFLOP/s | "
          "published | ratio | bubble | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    records = []
    from meshplan.progress import progress
    for name in progress(rows, total=len(rows), desc="published rows", unit="row"):
        r = run_row(name)
        records.append(r)
        print(f"| {name} | {r['method']} | {r['microbatches']} | {r['planner_step_s']:.3f} | "
              f"{r['step_s']:.3f} | {r['tflops']:.1f} | {r['published_tflops']:.1f} | "
              f"{r['ratio']:.3f} | {r['bubble']:.3f} | {r['peak_gib']:.1f} of "
              f"{r['device_gib']:.0f} |", flush=True)
    _write(args.json, records)
    if args.auto:
        # The fewest GPUs first (the quickest searches); each result is kept as it comes.
        by_size = sorted(records, key=lambda r: gpus(r["row"]))
        with ThreadPoolExecutor(args.jobs) as pool:   # threads only wait on their children
            futures = {pool.submit(run_auto, r["row"], args.timeout): r for r in by_size}
            for f in as_completed(futures):
                r = futures[f]
                r["auto"] = f.result()
                print(f"auto {r['row']}: {r['auto'].get('status')}, "
                      f"{r['auto'].get('wall_s', 0):.0f} s", flush=True)
                _write(args.json, records)
        print()
        print("\n".join(auto_table(records, {r["row"]: r["auto"] for r in records})),
              flush=True)
    return 0


def _write(path: str | None, records: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
