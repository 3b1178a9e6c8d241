"""``make demo-pipeline``: ``auto`` plans a GPT for hosts joined by slow Ethernet and splits
it into pipeline stages; N local gloo processes train that plan and match one device.

Run as ``python -m meshplan.demo_pipeline [--nproc 4]``. The plan is made for N V100s, two on
each of N/2 p3.16xlarge-like hosts (``p3.16xlarge:N/2x2``: NVLink inside a host, 25 Gb/s
between), where data or tensor parallelism across the hosts costs more than sending the
activations of each micro-batch (and the tied embedding's gradient) between stages, as the
simulator runs them, so the two-level search puts a stage on each host. N local processes then
run that very plan with `PipelineTrainer` (the numbers of a plan do not depend on the hardware
it runs on), and a single-device run from the same initial state gives the reference losses.
(On two hosts of four the simulated pipeline is slower than one stage — its transfers share
each host's one link — and ``auto`` answers one stage.)
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import meshplan.api as api
from meshplan.capture.batch import split_microbatches, step_loss
from meshplan.runtime.comm import ProcessGroupComm
from meshplan.runtime.launcher import launch
from meshplan.runtime.optim import OptimizerSpec, make_optimizer
from meshplan.runtime.p2p import ProcessGroupP2P
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.runtime.pool import WorkerPool
from meshplan.zoo.spec import build_workload

# Six layers: enough compute per stage that a stage per host beats keeping to one host (with 4
# layers, on 2 x 4 devices, replicating the work across the hosts and splitting it inside each
# one is 25 % faster by the calibrated 25 Gb/s Ethernet).
SPEC = "gpt:hidden=512,layers=6,heads=8,seq=64,vocab=1024,batch=16"
STEPS = 10
OPT = OptimizerSpec("sgd", lr=0.1)


def _data(steps: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []   # next token of a repeating sequence: a learnable toy task
    for _ in range(steps):
        start = torch.randint(0, 1024, (16, 1), generator=g)
        seq = (start + torch.arange(65)) % 1024
        out.append(((seq[:, :-1],), seq[:, 1:]))
    return out


def pipeline_plan(nproc: int, spec: str = SPEC) -> api.Plan:
    """``auto``'s plan of ``spec`` (fp32) for ``nproc`` V100s, two per host."""
    if nproc < 4 or nproc % 2:
        raise ValueError(f"--nproc must be an even number >= 4 (hosts of two), got {nproc}")
    meta = build_workload(spec, device="meta")
    return api.plan(meta.model, meta.loss_fn, OPT, meta.example_batch,
                    f"p3.16xlarge:{nproc // 2}x2", dtype="fp32", memory_budget_gb=0, name=spec)


def _worker(rank: int, nprocs: int, plan: api.Plan, spec: str, data: list) -> list[float]:
    w = build_workload(spec, device="cpu", seed=0)
    comm = ProcessGroupComm.for_stages(plan.stage_meshes())
    trainer = PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, ProcessGroupP2P())
    return [trainer.step(b, seed=i) for i, b in enumerate(data)]


def single_device(spec: str, data: list, microbatches: int) -> list[float]:
    """The reference: one device, gradients accumulated over the same micro-batches."""
    w = build_workload(spec, device="cpu", seed=0)
    model = copy.deepcopy(w.model)
    opt = make_optimizer(OPT, model.parameters())
    losses = []
    for batch in data:
        total = 0.0
        for (x,), t in split_microbatches(batch, microbatches):
            loss = step_loss(w.loss_fn, model(x), t)
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def run(nproc: int, steps: int = STEPS, pool: WorkerPool | None = None
        ) -> tuple[api.Plan, list[float], list[float]]:
    """Plan, train ``steps`` steps on ``nproc`` processes and on one device: (plan, losses,
    reference losses). The processes are spawned for the run, or ``pool``'s ``nproc`` workers
    (the tests' shared pool, which spares a spawn)."""
    plan = pipeline_plan(nproc)
    data = _data(steps)
    args = (plan, SPEC, data)
    if pool is None:
        losses = launch(_worker, nproc, args, timeout_s=600)[0]
    else:
        losses = pool.run(_worker, *args, timeout_s=600)[0]
    return plan, losses, single_device(SPEC, data, plan.microbatches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4, help="local gloo processes (default 4)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    plan, losses, ref = run(args.nproc)
    print(plan.explain())
    print(f"\n{'step':>4}  {'pipeline loss':>14}  {'one device':>11}")
    for i, (a, b) in enumerate(zip(losses, ref)):
        print(f"{i:>4}  {a:>14.6f}  {b:>11.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"\n{plan.num_stages} stages on {args.nproc} processes; largest relative difference "
          f"from one device {worst:.2e} ({time.perf_counter() - t0:.0f} s)")
    if plan.num_stages < 2 or worst > 1e-5:
        raise SystemExit("demo failed: expected a pipeline equal to one device")


if __name__ == "__main__":
    main()
