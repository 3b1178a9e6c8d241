"""Hugging Face models by name, planned and simulated: `meshplan plan hf:NAME` on a sensible
cluster for each (issue 26.4). Prints a markdown table: the plan, its simulated step time and
MFU, and the search time.

Usage: python benchmarks/hf_named.py [--row NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

# name: (hf spec, cluster)
ROWS = {
    "gpt2": ("hf:gpt2,batch=64,seq=1024", "dgx-a100:1"),
    "bert-base": ("hf:bert-base,batch=256,seq=512", "dgx-a100:1"),
    "t5-base": ("hf:t5-base,batch=128,seq=512", "dgx-a100:1"),
    "llama-3.2-1b": ("hf:llama-3.2-1b,batch=64,seq=2048", "dgx-h100:1"),
    "llama-3-8b": ("hf:llama-3-8b,batch=256,seq=4096", "dgx-h100:4"),
    "llama-3-70b": ("hf:llama-3-70b,batch=512,seq=4096", "dgx-h100:8"),
    "mixtral-8x7b": ("hf:mixtral-8x7b,batch=256,seq=4096", "dgx-h100:4"),
    "deepseek-v2-lite": ("hf:deepseek-v2-lite,batch=64,seq=2048", "dgx-a100:1"),
}


def run_row(name: str) -> dict:
    import meshplan.api as api
    from meshplan.sim.simulate import simulate
    from meshplan.zoo.spec import build_workload
    spec, cluster = ROWS[name]
    w = build_workload(spec)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, name=spec)
    searched = time.perf_counter() - t0
    sim = simulate(plan)
    stages = ", ".join(f"{s.mesh_shape[0]}x{s.mesh_shape[1]}" for s in plan.stages) \
        if plan.num_stages > 1 else f"{plan.mesh_shape[0]}x{plan.mesh_shape[1]}"
    return {"row": name, "spec": spec, "cluster": cluster, "stages": plan.num_stages,
            "meshes": stages, "microbatches": plan.microbatches, "dtype": plan.dtype,
            "step_s": sim.step_time_s, "mfu": sim.mfu, "search_s": searched,
            "peak_gib": max(sim.peak_memory_bytes) / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", action="append", choices=sorted(ROWS))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    print("| model | cluster | stages (meshes) | B | dtype | simulated step s | MFU | "
          "peak GiB | search s |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    records = []
    for name in args.row or list(ROWS):
        r = run_row(name)
        records.append(r)
        print(f"| `{r['spec']}` | {r['cluster']} | {r['stages']} ({r['meshes']}) | "
              f"{r['microbatches']} | {r['dtype']} | {r['step_s']:.3f} | {r['mfu']:.2f} | "
              f"{r['peak_gib']:.1f} | {r['search_s']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
