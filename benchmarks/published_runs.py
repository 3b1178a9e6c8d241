"""Simulated against published: the plans of published runs, simulated, next to their measured
throughput (`../shared/reference/perf_tables.md`).

Megatron-LM's Table 1 rows on DGX A100 (§1) and the Megatron-LM plans of Alpa's GPT rows on
p3.16xlarge (§2), each planned with its published configuration (method
``megatron:dp=…,tp=…,pp=…,mb=…[,virtual=…]``, fp16, full recomputation, Adam) and the
attention those runs used (scores materialized: ``flash=0``), then simulated
(`meshplan.sim.simulate`). TFLOP/s per GPU are counted as the publications count them
(recomputation included). Each row is planned within its device's memory, recomputed layer by
layer as Megatron-LM's full recomputation is; ``peak GiB`` is the simulated peak per device.

Usage: python benchmarks/published_runs.py [--row NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings

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
    w = build_workload(f"gpt:preset={preset},batch={batch},flash=0", device="meta")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", action="append", choices=sorted(ROWS))
    ap.add_argument("--json", metavar="PATH", help="also write the records as JSON")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
