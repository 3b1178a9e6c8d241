"""HAP's benchmark (EuroSys'24 §6) by the cost model: VGG19, ViT, BERT-Base and BERT-MoE on
HAP's cluster of 2 x 8 V100 and 6 x 8 P100 at 10.4 Gb/s (examples/clusters/hap_v100_p100.yaml).

Usage: python benchmarks/hetero_hap.py [--model vgg19|vit|bert|bert-moe ...]
Prints a markdown table of predicted step times (seconds, fp32, Adam; weak scaling as HAP
trains: 64 samples per GPU, 32 for BERT-MoE — HAP §6, the seed's text; perf_tables §3 says 32
for all) for method hetero (program synthesis + shard-ratio LP), dp-even (HAP's DP-EV),
dp-proportional (DP-CP) and the homogeneous ILP's plan on the cluster's 8x8 mesh
(intra-only: even shares, so the slowest device sets the pace), the speedup of hetero over
each, and the planning time of each method (hetero's is capture + synthesis + LP).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import meshplan
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.progress import progress
from meshplan.zoo.spec import build_workload

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                       "hap_v100_p100.yaml")
GPUS = 64
MODELS = {   # perf_tables.md §3, HAP's config.py
    "vgg19": f"vgg19:batch={64 * GPUS}",
    "vit": f"vit:hidden=768,layers=12,heads=12,patch=4,image=32,classes=10,batch={64 * GPUS}",
    "bert": f"bert:preset=base,batch={64 * GPUS}",
    "bert-moe": f"moe:hidden=768,layers=12,heads=12,experts={2 * GPUS},seq=128,vocab=30522,"
                f"capacity=2.5,expert_ffn=4,batch={32 * GPUS}",
}
METHODS = ("hetero", "dp-even", "dp-proportional", "intra-only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--cluster", default=CLUSTER, help="cluster YAML (default: HAP's)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cluster = parse_cluster_spec(args.cluster)
    print("| model | " + " | ".join(f"{m} (s)" for m in METHODS)
          + " | hetero vs dp-even | vs dp-prop. | vs homogeneous | hetero ratios V100 / P100 "
            "| planning time (s) |")
    print("|---|" + "---|" * (len(METHODS) + 5))
    names = args.model or list(MODELS)
    for name in progress(names, total=len(names), desc="HAP models", unit="model"):
        w = build_workload(MODELS[name], device="meta")
        times, plan_s, ratios = {}, {}, ""
        for method in METHODS:
            t0 = time.perf_counter()
            try:
                p = meshplan.plan(w.model, w.loss_fn, "adam", w.example_batch, cluster,
                                  method=method, dtype="fp32", microbatches=1, name=name)
            except meshplan.InfeasiblePlanError:
                times[method] = None
            else:
                times[method] = p.predicted["step_time_s"]
                if method == "hetero":
                    r = p.options["hetero"]["ratios"]
                    ratios = f"{r[0]:.4f} / {r[-1]:.4f}"
            plan_s[method] = time.perf_counter() - t0

        def cell(m: str) -> str:
            return "does not fit" if times[m] is None else f"{times[m]:.3f}"

        def ratio(m: str) -> str:
            if times[m] is None or times["hetero"] is None:
                return "–"
            return f"{times[m] / times['hetero']:.2f}x"

        print(f"| {name} | " + " | ".join(cell(m) for m in METHODS)
              + f" | {ratio('dp-even')} | {ratio('dp-proportional')} | {ratio('intra-only')} | "
              f"{ratios} | " + ", ".join(f"{m} {plan_s[m]:.1f}" for m in METHODS) + " |",
              flush=True)


if __name__ == "__main__":
    main()
