"""``make demo``: plan a small GPT for 4 local processes, train 20 steps, compare with one device.

Run as ``python -m meshplan.demo``. Everything is real: the plan comes from the ILP (unit α/β
costs, so it uses tensor parallelism even on this CPU), four gloo processes train with it, and a
single-device run from the same initial state gives the reference losses.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch

import meshplan.api as api
from meshplan.runtime.comm import ProcessGroupComm
from meshplan.runtime.launcher import launch
from meshplan.runtime.optim import OptimizerSpec, make_optimizer
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import build_workload

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=256,batch=8"
STEPS = 20
OPT = OptimizerSpec("adamw", lr=3e-3)


def _data(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    # A learnable toy task: predict the next token of a repeating sequence.
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, 256, (8, 1), generator=g)
        seq = (start + torch.arange(33)) % 256
        out.append(((seq[:, :-1],), seq[:, 1:]))
    return out


def _worker(rank: int, nprocs: int, plan, data) -> tuple[list[float], list[float]]:
    comm = ProcessGroupComm(plan.mesh_shape)
    w = build_workload(SPEC, device="cpu", seed=0)
    trainer = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
    losses, times = [], []
    for batch in data:
        t0 = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(time.perf_counter() - t0)
    return losses, times


def _single_device(data: list) -> tuple[list[float], list[float]]:
    w = build_workload(SPEC, device="cpu", seed=0)
    model = copy.deepcopy(w.model)
    opt = make_optimizer(OPT, model.parameters())
    losses, times = [], []
    for (inputs, target) in data:
        t0 = time.perf_counter()
        loss = w.loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def main() -> None:
    warnings.simplefilter("ignore")
    meta = build_workload(SPEC, device="meta")
    print(f"model {SPEC}  ({sum(p.numel() for p in meta.model.parameters()):,} parameters)")
    plan = api.plan(meta.model, meta.loss_fn, OPT, meta.example_batch, "local:4",
                    mesh_shape=(2, 2), alpha=(1.0, 1.0), beta=(1.0, 1.0), memory_budget_gb=0,
                    name=SPEC)
    print(plan.explain())
    data = _data()
    print(f"\ntraining {STEPS} steps on 4 gloo processes...")
    results = launch(_worker, 4, (plan, data))
    losses, times = results[0]
    ref_losses, ref_times = _single_device(data)
    print(f"\n{'step':>4} {'meshplan (4 procs)':>20} {'single device':>15} {'|diff|':>10}")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"{i:>4} {a:>20.6f} {b:>15.6f} {abs(a - b):>10.2e}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"\nlargest relative loss difference: {worst:.2e}")
    print(f"median step time: meshplan {statistics.median(times) * 1e3:.1f} ms on 4 processes, "
          f"single device {statistics.median(ref_times) * 1e3:.1f} ms (a CPU demo of "
          "correctness, not speed: 2 cores, gloo over loopback)")


if __name__ == "__main__":
    main()
