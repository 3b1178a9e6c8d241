"""Runtime overhead: meshplan's training step against PyTorch's own parallelisms, on the same
model, the same gloo processes and the same batches.

The zoo GPT (default hidden 256, 4 layers, seq 128, batch 16, AdamW) on P local gloo processes
(`meshplan.runtime.pool.WorkerPool`, one torch thread each), four pairs:

  data      torch DDP (default 25 MiB buckets)          vs meshplan method "data"
  zero3     torch FSDP2 (fully_shard per block + root)  vs meshplan method "zero3"
  megatron  torch TP (parallelize_module, Colwise/Rowwise, vocab-parallel embedding + loss)
                                                        vs meshplan "megatron" on mesh (1, P)
  pipeline  torch.distributed.pipelining, 2 stages, Schedule1F1B (DDP per stage when P > 2)
                                                   vs meshplan "megatron:dp=P/2,tp=1,pp=2,mb=.."

Both sides of a pair live in the same worker processes: every rank builds each side's model
with the same seed (same initial weights) and a `torch.optim.AdamW` with the same settings; each
round runs one step of each side on the same global batch, the order alternating per round so
machine noise falls on both alike. A step is timed on every rank from a barrier to the return of
``optimizer.step()``/``zero_grad()`` (meshplan: ``model(batch)``, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()`` under `meshplan.parallelize`); its time is the
slowest rank's. Reported: medians over ``--steps`` rounds after ``--warmup`` rounds, the ratio
meshplan / torch of the medians against its target, the per-round ratios (the two steps of a
round run back to back, so their ratio is the least disturbed by other jobs' load; their spread
says how noisy the run was), and the step-1 losses of both sides (the whole batch's mean
cross-entropy from the same weights: they must agree, or the two would time different math).

Where a target is missed (or with ``--profile``) the step's phases are printed side by side
(`time.perf_counter` on each rank between the calls a user makes, the slowest rank's per phase;
meshplan's gradient synchronization, which runs in a pre-hook of ``optimizer.step()``, is timed
apart from the update by a pre-hook registered after it). ``--profile`` also profiles one more
step of each side on rank 0 with `torch.profiler` (top ops by self CPU time).

The adaptations torch's side needs on gloo CPU are in `torch_baselines.py` (tensor parallel:
local heads, as DTensor has no CPU SDPA rule; tied embedding across pipeline stages).

Usage:
  python benchmarks/runtime_overhead.py [--nproc 2 4] [--pair data zero3 megatron pipeline]
      [--spec gpt:...] [--steps 6] [--warmup 2] [--microbatches 4] [--lr 1e-3]
      [--json PATH] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))   # this checkout's meshplan, not an installed one
sys.path.insert(0, _HERE)
import meshplan  # noqa: E402
import torch_baselines as tb  # noqa: E402
from meshplan.runtime.pool import WorkerPool  # noqa: E402
from meshplan.zoo.spec import build_workload, parse_model_spec  # noqa: E402

DEFAULT_SPEC = "gpt:hidden=256,layers=4,heads=4,seq=128,vocab=2048,batch=16"
PAIRS = ("data", "zero3", "megatron", "pipeline")
TORCH_SIDE = {"data": "DDP", "zero3": "FSDP2", "megatron": "TP", "pipeline": "pipelining"}
TARGETS = {"data": 1.05, "zero3": 1.10, "megatron": 1.15, "pipeline": 1.15}
PHASES = ("forward", "backward", "schedule", "sync", "optimizer")


# ---------------------------------------------------------------- plans (parent process)
def plan_for(pair: str, spec: str, nproc: int, microbatches: int) -> tuple[meshplan.Plan, str]:
    """meshplan's plan of ``pair`` on ``local:nproc`` (fp32, no memory budget) and its method
    text. Raises ValueError when the batch does not split as the pipeline pair needs."""
    w = build_workload(spec, device="meta")
    kw: dict[str, Any] = {"mesh_shape": (1, nproc), "microbatches": 1}
    method = pair
    if pair == "pipeline":
        batch = int(parse_model_spec(spec).get("batch"))
        dp = nproc // 2
        if nproc % 2 or batch % (dp * microbatches):
            raise ValueError(f"the pipeline pair needs an even --nproc and a batch divisible by "
                             f"P/2 x micro-batches; got P={nproc}, batch={batch}, "
                             f"micro-batches={microbatches}")
        method = f"megatron:dp={dp},tp=1,pp=2,mb={batch // (dp * microbatches)}"
        kw = {"microbatches": "auto"}   # the mb= above fixes the count
    plan = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, f"local:{nproc}",
                         method=method, memory_budget_gb=0, dtype="fp32", name=spec, **kw)
    return plan, method


def make_batches(spec: str, count: int, seed: int) -> list[tb.Batch]:
    """``count`` global batches of the GPT ``spec``: tokens and targets uniform in the vocab."""
    fields = parse_model_spec(spec)
    shape = (int(fields.get("batch")), int(fields.get("seq")))
    vocab = int(fields.get("vocab"))
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, vocab, shape, generator=gen),),
             torch.randint(0, vocab, shape, generator=gen)) for _ in range(count)]


# ---------------------------------------------------------------- the two sides (workers)
def meshplan_system(plan: meshplan.Plan, spec: str, rank: int, lr: float) -> tb.System:
    """The user's loop under `meshplan.parallelize`, its phases timed. meshplan's
    ``model(batch)`` returns the whole batch's loss on every rank (rank 0 counts it)."""
    w = build_workload(spec, device="cpu", seed=0)
    opt = torch.optim.AdamW(w.model.parameters(), lr=lr)
    model, opt = meshplan.parallelize(w.model, opt, plan, w.loss_fn)
    piped = plan.num_stages > 1
    clock: list[tb.Clock] = []
    hooked = [False]

    def step(batch: tb.Batch) -> tb.StepResult:
        clock[:] = [tb.Clock()]
        loss = model(batch)
        clock[0].lap("schedule" if piped else "forward")
        if not hooked[0]:
            # parallelize's own pre-hook (gradient sync) is registered at the first call:
            # this one, registered after it, runs after it.
            opt.register_step_pre_hook(lambda *_: clock[0].lap("sync"))
            hooked[0] = True
        loss.backward()   # a pipeline ran its backward in the schedule: nothing left
        clock[0].lap("schedule" if piped else "backward")
        opt.step()
        opt.zero_grad()
        clock[0].lap("optimizer")
        rows = float(len(batch[1]))
        return tb.StepResult(clock[0].phases, float(loss.detach()) * rows, rows) if rank == 0 \
            else tb.StepResult(clock[0].phases)

    return tb.System("meshplan", step)


def torch_system(pair: str, spec: str, rank: int, nprocs: int, lr: float,
                 microbatches: int) -> tb.System:
    """PyTorch's parallelism of ``pair`` on this rank (`torch_baselines`)."""
    model = build_workload(spec, device="cpu", seed=0).model
    if pair == "pipeline":
        return tb.pipeline(model, rank, nprocs, lr, microbatches)
    build: dict[str, Callable[..., tb.System]] = {"data": tb.ddp, "zero3": tb.fsdp2,
                                                  "megatron": tb.tensor_parallel}
    return build[pair](model, rank, nprocs, lr)


def _timed(system: tb.System, batch: tb.Batch) -> dict[str, Any]:
    dist.barrier()
    t0 = time.perf_counter()
    out = system.step(batch)
    return {"step_s": time.perf_counter() - t0, "phases": out.phases,
            "loss_sum": out.loss_sum, "rows": out.rows}


def _profiled(system: tb.System, batch: tb.Batch, rank: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    if rank != 0:   # the peers step unprofiled
        system.step(batch)
        return ""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        system.step(batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def time_pair(rank: int, nprocs: int, pair: str, spec: str, plan: meshplan.Plan,
              batches: list[tb.Batch], lr: float, microbatches: int,
              profile: bool) -> dict[str, Any]:
    """Worker: both sides of ``pair`` built on this rank, then one step of each per batch,
    the order alternating per round. Returns this rank's records (and profiles)."""
    warnings.simplefilter("ignore")
    sides = {"torch": torch_system(pair, spec, rank, nprocs, lr, microbatches),
             "meshplan": meshplan_system(plan, spec, rank, lr)}
    records: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for i, batch in enumerate(batches):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for key in order:
            records[key].append(_timed(sides[key], batch))
    out: dict[str, Any] = {"records": records, "notes": sides["torch"].notes}
    if profile:
        out["profiles"] = {k: _profiled(s, batches[-1], rank) for k, s in sides.items()}
    return out


# ---------------------------------------------------------------- summary (parent process)
def summarize(ranks: list[dict[str, Any]], side: str, warmup: int) -> dict[str, Any]:
    """One side's numbers from every rank's records: per step the slowest rank's time and
    phases and the global mean loss; medians over the steps after ``warmup``."""
    recs = [r["records"][side] for r in ranks]
    count = len(recs[0])
    steps = [max(rk[i]["step_s"] for rk in recs) for i in range(count)]
    losses = [sum(rk[i]["loss_sum"] for rk in recs) / sum(rk[i]["rows"] for rk in recs)
              for i in range(count)]
    names = [p for p in PHASES if any(p in rk[i]["phases"] for rk in recs for i in range(count))]
    phases = {p: 1e3 * statistics.median(max(rk[i]["phases"].get(p, 0.0) for rk in recs)
                                         for i in range(warmup, count)) for p in names}
    return {"step_ms": 1e3 * statistics.median(steps[warmup:]),
            "steps_ms": [1e3 * s for s in steps], "losses": losses, "phases_ms": phases}


def run_nproc(nproc: int, args: argparse.Namespace, batches: list[tb.Batch]
              ) -> list[dict[str, Any]]:
    """Every requested pair on one pool of ``nproc`` processes."""
    plans = {pair: plan_for(pair, args.spec, nproc, args.microbatches) for pair in args.pair}
    rows = []
    with WorkerPool(nproc, timeout_s=900.0, collective_timeout_s=120.0) as pool:
        for pair in args.pair:
            plan, method = plans[pair]
            t0 = time.perf_counter()
            ranks = pool.run(time_pair, pair, args.spec, plan, batches, args.lr,
                             args.microbatches, args.profile)
            torch_side = summarize(ranks, "torch", args.warmup)
            mine = summarize(ranks, "meshplan", args.warmup)
            rows.append({
                "nproc": nproc, "pair": pair, "torch_system": TORCH_SIDE[pair],
                "meshplan_method": method, "torch": torch_side, "meshplan": mine,
                "ratio": mine["step_ms"] / torch_side["step_ms"], "target": TARGETS[pair],
                "round_ratios": [m / t for m, t in zip(mine["steps_ms"][args.warmup:],
                                                       torch_side["steps_ms"][args.warmup:])],
                "loss_diff_step1": abs(mine["losses"][0] - torch_side["losses"][0]),
                "loss_diff_last": abs(mine["losses"][-1] - torch_side["losses"][-1]),
                "notes": ranks[0]["notes"], "profiles": ranks[0].get("profiles"),
                "wall_s": time.perf_counter() - t0})
            print(f"P={nproc} {pair}: {TORCH_SIDE[pair]} {torch_side['step_ms']:.0f} ms, "
                  f"meshplan {mine['step_ms']:.0f} ms ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| P | pair | torch | torch step (ms) | meshplan | meshplan step (ms) | "
          "meshplan / torch | target | met | per-round ratio: median (min-max) | "
          "step-1 loss torch / meshplan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        met = "yes" if r["ratio"] <= r["target"] else "**no**"
        rr = r["round_ratios"]
        print(f"| {r['nproc']} | {r['pair']} | {r['torch_system']} | "
              f"{r['torch']['step_ms']:.0f} | {r['meshplan_method']} | "
              f"{r['meshplan']['step_ms']:.0f} | {r['ratio']:.3f}x | <= {r['target']:.2f}x | "
              f"{met} | {statistics.median(rr):.2f}x ({min(rr):.2f}-{max(rr):.2f}) | "
              f"{r['torch']['losses'][0]:.6f} / {r['meshplan']['losses'][0]:.6f} |")
    print(f"\nmax |step-1 loss difference| {max(r['loss_diff_step1'] for r in rows):.2e}; "
          f"after the last step {max(r['loss_diff_last'] for r in rows):.2e} "
          "(the same weights and batches: the two sides compute the same losses)")
    notes = {(r["torch_system"], n) for r in rows for n in r["notes"]}
    for system, note in sorted(notes):
        print(f"- torch {system}: {note}")


def print_breakdowns(rows: list[dict[str, Any]], every: bool) -> None:
    """The phases of each pair that missed its target (every pair with ``every``)."""
    for r in rows:
        if not every and r["ratio"] <= r["target"]:
            continue
        a, b = r["torch"]["phases_ms"], r["meshplan"]["phases_ms"]
        print(f"\nP={r['nproc']} {r['pair']}: phases (ms, median over steps of the slowest "
              f"rank); step {r['torch']['step_ms']:.0f} vs {r['meshplan']['step_ms']:.0f}")
        print(f"| phase | {r['torch_system']} | meshplan |\n|---|---|---|")
        for p in PHASES:
            if p in a or p in b:
                cells = [f"{d[p]:.0f}" if p in d else "–" for d in (a, b)]
                print(f"| {p} | {cells[0]} | {cells[1]} |")
        for side, text in (r.get("profiles") or {}).items():
            print(f"\n{side}, one step on rank 0 (torch.profiler):\n```\n{text}```")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="a zoo GPT spec (default: %(default)s)")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pair", nargs="+", choices=PAIRS, default=list(PAIRS))
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (medians over them)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--microbatches", type=int, default=4, help="of the pipeline pair")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="of the batches")
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    ap.add_argument("--profile", action="store_true",
                    help="phase breakdown of every pair, and torch.profiler of one step")
    args = ap.parse_args(argv)
    if parse_model_spec(args.spec).kind != "gpt":
        raise SystemExit(f"--spec must be a zoo GPT (gpt:...), got {args.spec!r}")
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be >= 1 (step 1's losses are compared)")
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    batches = make_batches(args.spec, args.warmup + args.steps, args.seed)
    rows = [r for n in args.nproc for r in run_nproc(n, args, batches)]
    print(f"{args.spec}, AdamW lr {args.lr}, fp32, gloo on {os.cpu_count()} cores "
          f"({platform.machine()}), torch {torch.__version__}; median of {args.steps} steps "
          f"after {args.warmup} warm-up; pipeline {args.microbatches} micro-batches, 1F1B\n")
    print_table(rows)
    print_breakdowns(rows, args.profile)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": args.spec, "steps": args.steps, "warmup": args.warmup,
                       "microbatches": args.microbatches, "lr": args.lr,
                       "torch": torch.__version__, "cores": os.cpu_count(),
                       "machine": platform.machine(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
