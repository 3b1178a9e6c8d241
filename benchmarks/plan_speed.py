"""Planning speed: trace + strategies + ILP, end to end, each repetition in a fresh process.

Usage: python benchmarks/plan_speed.py [--repeats 3] [--case NAME ...]
Prints a markdown table (median and all runs) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

from meshplan.progress import progress

CASES = {
    # name: (model spec, cluster, mesh)
    "gpt-1.3b-2x4": ("gpt:hidden=2048,layers=24,heads=32,seq=1024,vocab=51200,batch=1024",
                     "p3.16xlarge:1", (2, 4)),
    "gpt-39b-8x8": ("gpt:preset=39b,batch=1024", "p3.16xlarge:8", (8, 8)),
    "moe-70b-8x8": ("moe:preset=70b,batch=1024", "p3.16xlarge:8", (8, 8)),
    "wresnet-13b-8x8": ("wresnet:preset=13b,batch=1536", "p3.16xlarge:8", (8, 8)),
}

_ONE_RUN = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import meshplan.api as api
from meshplan.zoo.spec import build_workload
spec, cluster, mesh = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3]))
w = build_workload(spec)
t0 = time.perf_counter()
p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, mesh_shape=mesh,
             memory_budget_gb=0, name=spec)
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "search_s": p.search_time_s, "ilp": p.ilp,
                  "objective": p.objective, "step_s": p.predicted["step_time_s"]}))
"""


def run_once(spec: str, cluster: str, mesh: tuple[int, int]) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE_RUN, spec, cluster, json.dumps(mesh)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {platform.python_version()}, "
          f"{__import__('os').cpu_count()} cores\n")
    print("| case | mesh | median plan time (s) | runs (s) | ILP vars / constraints | "
          "ILP solve (s) | predicted step (s) |")
    print("|---|---|---|---|---|---|---|")
    cases = args.case or list(CASES)
    for name in progress(cases, total=len(cases), desc="plan speed", unit="case"):
        spec, cluster, mesh = CASES[name]
        runs = [run_once(spec, cluster, mesh) for _ in range(args.repeats)]
        walls = [r["wall_s"] for r in runs]
        last = runs[-1]
        print(f"| {name} | {mesh[0]}x{mesh[1]} | {statistics.median(walls):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in walls)} | {last['ilp']['variables']} / "
              f"{last['ilp']['constraints']} | {last['ilp']['solve_time_s']:.2f} | "
              f"{last['step_s']:.3g} |", flush=True)


if __name__ == "__main__":
    main()
