"""ILP vs baseline methods on Alpa's GPT, MoE and Wide-ResNet presets (p3.16xlarge, 1-64 GPUs).

Usage: python benchmarks/methods_table.py [--family gpt|moe|wresnet ...]
Prints a markdown table: per preset and GPU count, each method's objective (seconds per step by
the cost model, the ILP's objective) and predicted step time. No memory budget (these presets
need pipelining or rematerialization to fit 16 GB at these batch sizes). The ILP's objective
must be the smallest in every row.
"""

from __future__ import annotations

import argparse
import time
import warnings

import meshplan
from meshplan.zoo.spec import build_workload

SUITES = {
    "gpt": ("batch=1024", [("350m", 1), ("760m", 2), ("1.3b", 4), ("2.6b", 8), ("6.7b", 16),
                           ("15b", 32), ("39b", 64)]),
    "moe": ("batch=1024", [("380m", 1), ("690m", 2), ("1.3b", 4), ("2.4b", 8), ("10b", 16),
                           ("27b", 32), ("70b", 64)]),
    "wresnet": ("batch=1536", [("250m", 1), ("500m", 2), ("1b", 4), ("2b", 8), ("4b", 16),
                               ("6.8b", 32), ("13b", 64)]),
}
METHODS = ("auto", "data", "zero2", "zero3", "megatron", "heuristic", "expert")


def cluster_for(gpus: int) -> str:
    return f"p3.16xlarge:1x{gpus}" if gpus <= 8 else f"p3.16xlarge:{gpus // 8}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", action="append", choices=sorted(SUITES))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print("| model | GPUs | mesh | " + " | ".join(METHODS) + " | ILP plan time (s) |")
    print("|---|---|---|" + "---|" * (len(METHODS) + 1))
    for family in args.family or list(SUITES):
        batch, rows = SUITES[family]
        for preset, gpus in rows:
            w = build_workload(f"{family}:preset={preset},{batch}")
            cells, mesh, plan_time = [], None, 0.0
            for method in METHODS:
                if method == "expert" and family != "moe":
                    cells.append("–")
                    continue
                t0 = time.perf_counter()
                p = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch,
                                  cluster_for(gpus), method=method, memory_budget_gb=0)
                if method == "auto":
                    plan_time, mesh = time.perf_counter() - t0, p.mesh_shape
                cells.append(f"{p.objective:.3g}")
            print(f"| {family}-{preset} | {gpus} | {mesh[0]}x{mesh[1]} | " + " | ".join(cells)
                  + f" | {plan_time:.1f} |", flush=True)


if __name__ == "__main__":
    main()
