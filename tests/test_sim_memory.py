"""Simulated peak memory against the peak PyTorch measures when the runtime runs the same plan
(issue 9: within 10 %, single-stage plans, small models on CPU processes).

The measurement is PyTorch's own: the profiler's allocation events (``profile_memory=True``)
from the moment the rank's `Trainer` is built — so its parameter shards, gradients, optimizer
state, saved activations and every temporary are counted, and nothing the test itself holds —
over two training steps (the second with the optimizer state the first created); the peak is
the largest total of bytes allocated and not yet freed.

Blocks are followed by address (the exported trace's ``Addr``), because the profiler records
only the frees of its own thread: a buffer handed to gloo is often freed last by gloo's worker
thread, unseen (measured: 10 all-gathers of 512 KiB left 0.25-0.75 MiB "allocated" although
every output had been freed). The rank's trainer is deleted inside the profile, so every block
it held is freed where it is seen; a block whose free was never seen was released by gloo,
once its collective ended, so it counts from its allocation to the next event only.

The batch is the test's, made before the profile: the runtime's share of it is a view of that
memory, which the profile never sees allocated. On a GPU the runtime holds its own copy of its
share for the step (the input a matmul keeps, the target), so the measured peak adds the
bytes of the local pieces the runtime takes (`Trainer.local_batch`, the tensors
themselves)."""

from __future__ import annotations

import gc
import json
import os
import tempfile

import pytest

import meshplan.api as api
from meshplan.runtime.comm import ProcessGroupComm
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import build_workload
from oracle import ADAMW, batches, make_plan

# Activations and state each far above the allocator's small change.
MLP = "mlp:layers=4,hidden=256,batch=4096,bias=1"
GPT = "gpt:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=16"
GPT4 = "gpt:hidden=128,layers=4,heads=4,seq=64,vocab=512,batch=16"


def held_peak(events: list[tuple[float, int, int]]) -> int:
    """The largest total of bytes held at once, from ``(time, address, bytes)`` allocation
    (bytes > 0) and free (bytes < 0) events; a block never seen freed (module docstring)
    counts only until the next event."""
    events = sorted(events)
    freed: set[int] = set()    # indices of allocations whose free was seen
    open_at: dict[int, int] = {}
    for i, (_, addr, nbytes) in enumerate(events):
        if nbytes > 0:
            open_at[addr] = i
        elif addr in open_at:
            freed.add(open_at.pop(addr))
    total = peak = 0
    live: dict[int, int] = {}
    unseen = 0   # bytes of the last event's block whose free is never seen
    for i, (_, addr, nbytes) in enumerate(events):
        total -= unseen
        unseen = 0
        if nbytes > 0:
            total += nbytes
            if i in freed:
                live[addr] = nbytes
            else:
                unseen = nbytes
        elif addr in live:
            total -= live.pop(addr)
        peak = max(peak, total)
    return peak


def measured_peak(rank: int, nprocs: int, plan, spec: str, data) -> int:
    """The largest total of bytes the rank's runtime held at once, by the profiler."""
    import torch

    from meshplan.runtime.trainer import Trainer
    comm = ProcessGroupComm(plan.mesh_shape)
    w = build_workload(spec, device="cpu", seed=0)
    peak = profiled_peak(lambda: Trainer(plan, w.model, w.loss_fn, w.example_batch, comm), data)
    torch.distributed.barrier()
    share = max(sum(t.nbytes for t in Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
                    .local_batch(batch)) for batch in data)
    return peak + share


def profiled_peak(make, data) -> int:
    """The largest total of bytes held at once, by the profiler, from building the trainer
    (``make()``) through its steps on ``data`` to its deletion."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = make()
        for batch in data:
            trainer.step(batch)
        del trainer
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    return held_peak([(e["ts"], int(e["args"]["Addr"]), int(e["args"]["Bytes"]))
                      for e in trace if e.get("name") == "[memory]"])


def test_held_peak_counts_unseen_frees_as_brief() -> None:
    # a (100 B) and b (50 B) freed where seen; c (30 B) never seen freed: it counts at its
    # allocation only, then d (60 B) comes while a is held.
    events = [(0, 1, 100), (1, 2, 50), (2, 3, 30), (3, 2, -50), (4, 4, 60), (5, 1, -100),
              (6, 4, -60)]
    assert held_peak(events) == 180   # a + b + c at t=2
    assert held_peak(events[:2] + events[3:]) == 160   # without c: a + d


@pytest.mark.parametrize("spec,method,opt", [
    (MLP, "data", ADAMW),
    (GPT, "data", ADAMW),
    (MLP, "zero3", ADAMW),
    (GPT, "zero3", ADAMW),
    (GPT, "zero2", ADAMW),
    (GPT, "megatron", ADAMW),
    (GPT4, "megatron", ADAMW),
], ids=["mlp-data-adamw", "gpt-data-adamw", "mlp-zero3-adamw", "gpt-zero3-adamw",
        "gpt-zero2-adamw", "gpt-megatron-adamw", "gpt4-megatron-adamw"])
def test_simulated_peak_memory_matches_measured(pool2, spec: str, method: str, opt) -> None:
    plan = make_plan(spec, (1, 2), method, opt)
    data = batches(build_workload(spec, device="cpu", seed=0), 2)
    simulated = simulate(plan).peak_memory_bytes
    for rank, peak in enumerate(pool2.run(measured_peak, plan, spec, data)):
        assert simulated[rank] == pytest.approx(peak, rel=0.10), (rank, simulated[rank], peak)


def _pipeline_peak(rank: int, nprocs: int, plan, spec: str, data) -> int:
    """The largest total of bytes a pipeline rank held at once, by the profiler."""
    from meshplan.runtime.comm import ProcessGroupComm
    from meshplan.runtime.p2p import ProcessGroupP2P
    from meshplan.runtime.pipeline import PipelineTrainer
    comm = ProcessGroupComm.for_stages(plan.stage_meshes())
    p2p = ProcessGroupP2P("cpu")
    w = build_workload(spec, device="cpu", seed=0)
    return profiled_peak(lambda: PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch,
                                                 comm, p2p), data)


def check_two_stage_peak(pool, spec: str, recompute: str, dp: int = 1, rel: float = 0.10,
                         **kw):
    """A 2-stage pipeline of ``spec`` (4 micro-batches, 1F1B, ``dp`` replicas per stage on
    ``pool``'s 2·dp ranks) recomputed as ``recompute`` (``kw``: more `api.plan` options):
    each rank's simulated peak within ``rel`` of the profiler's on gloo. Returns the plan."""
    w = build_workload(spec, device="meta")
    plan = api.plan(w.model, w.loss_fn, ADAMW, w.example_batch, f"local:{2 * dp}",
                    method=f"megatron:dp={dp},tp=1,pp=2", microbatches=4, recompute=recompute,
                    memory_budget_gb=0, dtype="fp32", name=spec, **kw)
    simulated = simulate(plan).peak_memory_bytes
    data = batches(build_workload(spec, device="cpu", seed=0), 2)
    for rank, peak in enumerate(pool.run(_pipeline_peak, plan, spec, data)):
        assert simulated[rank] == pytest.approx(peak, rel=rel), (rank, simulated[rank], peak)
    return plan


def test_a_zero2_pipelines_simulated_peak_is_measured(pool4) -> None:
    """ZeRO-2 stages hold a weight's whole gradient only until its reduce-scatter (the working
    set, 4 MiB here). Measured at 84 MiB against 50 simulated before the runtime bounded what
    it holds: it waited for a backward's reduce-scatters only when the backward ended, each
    holding a copy of its whole gradient, and its update gathered every parameter of the
    stage at once, twice over. The simulator held the working set twice (once in the stage's
    planned peak): within 3 % tells it from the 4 % that cost here (GPT-6.7B's first stage:
    16.03 GiB simulated on a 16 GiB V100 for a plan that fit as run)."""
    plan = check_two_stage_peak(pool4, "mlp:layers=8,hidden=1024,batch=64,bias=1", "none",
                                dp=2, rel=0.03, prefer_reduce_scatter=True)
    assert all(p.update == "zero2" for s in plan.stages for p in s.plan.params)


def test_a_replicated_pipelines_simulated_peak_is_measured(pool4) -> None:
    """Replicated stages all-reduce their gradients in buckets as the last backward fills them.
    Each bucket in flight held a copy of its gradients until the update, so at the end every
    gradient was held twice: 80.2 MiB measured against 72.4 simulated, before the gradients
    were let go into their buckets and given back as views of the sums."""
    plan = check_two_stage_peak(pool4, "mlp:layers=8,hidden=1024,batch=64,bias=1", "none",
                                dp=2, rel=0.03)
    assert all(p.update == "replicated" for s in plan.stages for p in s.plan.params)
