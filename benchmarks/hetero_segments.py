"""Per-segment shard ratios (HAP §5.2) by the cost model: the hetero program of each of HAP's
models on HAP's cluster with one ratio set and with K model segments balanced by the LP.

Usage: python benchmarks/hetero_segments.py [--model vgg19|vit|bert ...] [--segments 2 4]
Prints a markdown table: the one-set step, and per K the step of the program cut into K
segments with the LP's ratio sets (re-cuts included) and how many values are re-cut; the
planner keeps segments only where that step is lower. fp32, Adam, HAP's batches, as
`hetero_hap.py`.
"""

from __future__ import annotations

import argparse
import warnings

import meshplan
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.zoo.spec import build_workload
from hetero_hap import CLUSTER, MODELS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--segments", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cluster", default=CLUSTER, help="cluster YAML (default: HAP's)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cluster = parse_cluster_spec(args.cluster)
    print("| model | one set (s) | " + " | ".join(f"{k} segments (s), re-cuts"
                                                 for k in args.segments) + " |")
    print("|---|---:|" + "---:|" * len(args.segments))
    for name in args.model or ["vgg19", "vit", "bert"]:
        w = build_workload(MODELS[name], device="meta")
        cells, one = [], None
        for k in args.segments:
            p = meshplan.plan(w.model, w.loss_fn, "adam", w.example_batch, cluster,
                              method="hetero", dtype="fp32", microbatches=1, name=name,
                              segments=k)
            seg = p.options["hetero"]["segments"]
            one = seg["one_set_step_s"]
            mark = "**" if seg["kept"] else ""
            cells.append(f"{mark}{seg['step_s']:.3f}{mark}, {seg['recuts']}")
        print(f"| {name} | {one:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
