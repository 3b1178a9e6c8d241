"""Intra-operator planning speed on Hugging Face models: every intra-only plan of an 8-layer
Llama, GPT-2 and Qwen2 on each logical mesh of one 8-GPU host, each run in a fresh process
(issue 27.4: each within 30 s on a 2-core machine).

Usage: python benchmarks/intra_hf.py [--repeats 3] [--case NAME ...] [--mesh RxC ...]
Prints a markdown table (median wall seconds of plan(), the objective, the ILP's size and its
shared blocks) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

CASES = {
    "llama-8l": "hf:llama-3-8b,layers=8,hidden=1024,heads=16,kv=8,ffn=4096,batch=64,seq=2048",
    "gpt2-8l": "hf:gpt2,layers=8,batch=64,seq=2048",
    "qwen2-8l": "hf:qwen2.5-7b,layers=8,hidden=1024,heads=16,kv=2,ffn=4096,batch=64,seq=2048",
}
CLUSTER = "p3.16xlarge:1"
MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))

_ONE_RUN = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import meshplan.api as api
from meshplan.zoo.spec import build_workload
spec, cluster, mesh = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3]))
w = build_workload(spec, device="meta")
t0 = time.perf_counter()
p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, mesh_shape=mesh,
             name=spec)
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "objective": p.objective, "ilp": p.ilp}))
"""


def run_once(spec: str, mesh: tuple[int, int]) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE_RUN, spec, CLUSTER, json.dumps(mesh)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--mesh", action="append", help="RxC, e.g. 2x4 (default: all four)")
    args = ap.parse_args()
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.mesh] if args.mesh else MESHES
    print(f"python {platform.python_version()}, cluster {CLUSTER}, {args.repeats} runs each",
          flush=True)
    print("| case | mesh | plan s (median) | runs | objective s | ILP variables |")
    print("|---|---|---:|---|---:|---:|")
    for name in args.case or list(CASES):
        for mesh in meshes:
            runs = [run_once(CASES[name], mesh) for _ in range(args.repeats)]
            walls = [r["wall_s"] for r in runs]
            print(f"| {name} | {mesh[0]}x{mesh[1]} | {statistics.median(walls):.1f} | "
                  f"{', '.join(f'{w:.1f}' for w in walls)} | {runs[0]['objective']:.4f} | "
                  f"{runs[0]['ilp'].get('variables', '')} |", flush=True)


if __name__ == "__main__":
    main()
