"""A step failing on one rank (issue 26.2): how long until every rank has the same StepFailed,
and the step after it trains. Local gloo processes, a small GPT, one rank raising out of
memory at its first collective of a phase in step 1; the median of ``--repeats`` failures per
case. Prints a markdown table.

Usage: python benchmarks/step_failure.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
# (label, processes, method, micro-batches, where rank 1 fails)
CASES = [("data", 2, "data", 2, "update"), ("megatron, backward", 2, "megatron", 1, "backward"),
         ("zero3, backward", 2, "zero3", 2, "backward"),
         ("2x2 ILP plan", 4, "auto", 1, "update"),
         ("pipeline dp=2 pp=2, forward", 4, "megatron:dp=2,tp=1,pp=2", 2, "forward")]


def _rank(rank: int, nprocs: int, plan, where: str, repeats: int) -> list[float]:
    """Seconds from the start of each failing step to StepFailed on this rank."""
    import test_step_failure as T
    from meshplan.errors import StepFailed
    from meshplan.zoo.spec import build_workload
    from user_loop import parallel
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, _ = parallel(w, plan)
    armed, out = None, []
    for i in range(1 + 2 * repeats):
        b = T.DATA[i % len(T.DATA)]
        if armed is not None and i % 2 == 1 and rank == 1:
            armed["on"] = True
        t0 = time.perf_counter()
        try:
            model(b).backward()
            opt.step()
            opt.zero_grad()
        except StepFailed:
            out.append(time.perf_counter() - t0)
        if armed is None:
            armed = T._arm(model, opt, where)
    return out


def main() -> None:
    import meshplan.api as api
    from meshplan.runtime.optim import OptimizerSpec
    from meshplan.runtime.pool import WorkerPool
    from meshplan.zoo.spec import build_workload
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sgd = OptimizerSpec("sgd", lr=0.1)
    w = build_workload(GPT, device="meta", seed=0)
    print("| case | processes | where | failures | every rank raised it after (median, max) |")
    print("|---|---|---|---|---|")
    pools: dict[int, WorkerPool] = {}
    try:
        for label, n, method, mb, where in CASES:
            shape = {"data": (1, 2), "megatron": (1, 2), "zero3": (1, 2), "auto": (2, 2)}
            kw = {"mesh_shape": shape[method]} if method in shape else {}
            plan = api.plan(w.model, w.loss_fn, sgd, w.example_batch, f"local:{n}",
                            method=method, memory_budget_gb=0, microbatches=mb,
                            dtype="fp32", **kw)
            pool = pools.setdefault(n, WorkerPool(n))
            times = [t for per_rank in pool.run(_rank, plan, where, args.repeats)
                     for t in per_rank]
            print(f"| {label} | {n} | {where} | {len(times) // n} | "
                  f"{statistics.median(times) * 1e3:.0f} ms, {max(times) * 1e3:.0f} ms |")
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
