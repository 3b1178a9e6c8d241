"""Two-level search speed and outcome (pipeline stages, micro-batches, dtype), each run in a
fresh process.

Usage: python benchmarks/inter_search.py [--repeats 1] [--case NAME ...]
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HAP_CLUSTER = str(Path(__file__).resolve().parent.parent / "examples" / "clusters" /
                  "hap_v100_p100.yaml")

CASES = {
    # name: (model spec, cluster, extra plan() keywords)
    "gpt-wide-2x2": ("gpt:hidden=1024,layers=4,heads=8,seq=128,vocab=1024,batch=16",
                     "p3.16xlarge:2x2", {"microbatches": 8, "num_layers": 4}),
    "gpt-1.3b-1x8": ("gpt:hidden=2048,layers=24,heads=32,seq=1024,vocab=51200,batch=64",
                     "p3.16xlarge:1", {"microbatches": 8}),
    "gpt-1.3b-2x8": ("gpt:hidden=2048,layers=24,heads=32,seq=1024,vocab=51200,batch=128",
                     "p3.16xlarge:2", {"microbatches": 16}),
    # The speed targets: Alpa's largest GPT on its 64 V100s (16 GB each), fp16; GPT-3
    # 175B on 1024 A100s (80 GB), bf16. Every search choice automatic.
    "gpt-39b-p3x8": ("gpt:preset=39b,batch=1024", "p3.16xlarge:8", {"dtype": "fp16"}),
    "gpt-175b-dgx128": ("gpt:hidden=12288,layers=96,heads=96,seq=2048,vocab=51200,batch=1536",
                        "dgx-a100:128", {"dtype": "bf16"}),
    # Every Megatron-LM configuration (dp, tp, pp, micro-batch size 1-8) of 8 GPUs.
    "gpt-1.3b-1x8-megatron-grid": ("gpt:preset=1.3b,batch=1024", "p3.16xlarge:1",
                                   {"method": "megatron-grid"}),
    # The other targets: Alpa's largest MoE on its 64 V100s (Adafactor, as Alpa
    # trains its MoEs), and `auto` on HAP's mixed cluster (2 hosts of 8 V100, 6 of 8 P100)
    # with HAP's four models.
    "moe-70b-p3x8": ("moe:preset=70b,batch=1024", "p3.16xlarge:8",
                     {"dtype": "fp16", "optimizer": "adafactor"}),
    "hap-vgg19": ("vgg19:batch=4096", HAP_CLUSTER, {"dtype": "fp32"}),
    "hap-vit": ("vit:hidden=768,layers=12,heads=12,patch=4,image=32,classes=10,batch=4096",
                HAP_CLUSTER, {"dtype": "fp32"}),
    "hap-bert-base": ("bert:preset=base,batch=4096", HAP_CLUSTER, {"dtype": "fp32"}),
    "hap-bert-moe": ("moe:hidden=768,layers=12,heads=12,experts=128,seq=128,vocab=30522,"
                     "capacity=2.5,expert_ffn=4,batch=2048", HAP_CLUSTER, {"dtype": "fp32"}),
}

_ONE_RUN = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import meshplan.api as api
from meshplan.zoo.spec import build_workload
spec, cluster, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
optimizer = extra.pop("optimizer", "adamw")
w = build_workload(spec)
t0 = time.perf_counter()
p = api.plan(w.model, w.loss_fn, optimizer, w.example_batch, cluster, name=spec, **extra)
wall = time.perf_counter() - t0
mixed = p.options.get("mixed_auto")
print(json.dumps({"wall_s": wall, "stages": [[s.layers, s.submesh, s.mesh_shape, s.recompute]
                                             for s in p.stages],
                  "chosen": mixed["chosen"] if mixed else None,
                  "microbatches": p.microbatches, "dtype": p.dtype, "ilp": p.ilp,
                  "step_s": p.predicted["step_time_s"],
                  "memory_gib": p.predicted["peak_memory_bytes"] / 2**30}))
"""


def describe_stages(stages: list) -> str:
    """Stages as "layers submesh mesh [rc]", runs of alike stages (same layer count, submesh,
    mesh, recomputation) as "n x k layers submesh mesh"."""
    groups: list[list] = []
    for (a, b), sub, mesh, rc in stages:
        key = (b - a, tuple(sub), tuple(mesh), rc)
        if groups and groups[-1][0] == key:
            groups[-1][1] += 1
        else:
            groups.append([key, 1, (a, b)])
    return "; ".join(
        f"{n} x {k} layers {sub} {mesh}{' rc' if rc else ''}" if n > 1 else
        f"{first} {sub} {mesh}{' rc' if rc else ''}"
        for (k, sub, mesh, rc), n, first in groups)


def run_case(name: str) -> dict:
    spec, cluster, extra = CASES[name]
    out = subprocess.run([sys.executable, "-c", _ONE_RUN, spec, cluster, json.dumps(extra)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--case", action="append", choices=sorted(CASES))
    args = p.parse_args(argv)
    print(f"python {platform.python_version()}, {args.repeats} run(s) per case, fresh process "
          "each\n")
    print("| case | wall s (median; runs) | stages (layers, submesh, mesh, recompute) | B | dtype "
          "| stage ILPs | predicted step s | peak GiB |")
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for name in args.case or list(CASES):
        runs = [run_case(name) for _ in range(args.repeats)]
        r = runs[-1]
        stages = describe_stages(r["stages"]) or "one stage, every device"
        if r["chosen"]:   # a mixed cluster's "auto": which of its searches won
            stages = f"{r['chosen']}: {stages}"
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in runs)
        print(f"| {name} | {statistics.median(x['wall_s'] for x in runs):.1f} ({walls}) | "
              f"{stages} | "
              f"{r['microbatches']} | {r['dtype']} | {r['ilp'].get('stage_solves', 0)} | "
              f"{r['step_s']:.4g} | {r['memory_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
