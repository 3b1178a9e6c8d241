"""The pipeline runtime (`runtime/pipeline.py`) on emulated ranks: multi-stage plans train
equal to one device under GPipe and 1F1B, stage meshes of different shapes and intra plans, and
the runtime's own count of held micro-batches obeys the schedule's bound."""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import meshplan.api as api
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.lower.pipeline_program import pipeline_program
from meshplan.runtime.emulated import run_emulated_stages
from meshplan.runtime.optim import OptimizerSpec
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.zoo.spec import Workload, build_workload
from oracle import (SGD, ADAMW, assert_matches, batches, cpu_capture, plan_counter,
                    record_counter, reference)

MLP = "mlp:layers=6,hidden=16,batch=16,bias=1"
GPT = "gpt:hidden=32,layers=6,heads=4,seq=8,vocab=64,batch=8"   # embedding tied to the head


def _sent(records: list) -> Counter:
    """Point-to-point messages by (kind, source, destination, bytes), those a plan lists (not
    the loss report or the clipping norm)."""
    return Counter((r.kind, r.src, r.dst, r.nbytes) for r in records
                   if r.kind in ("activation", "gradient", "gather", "tied"))


def _planned_sends(plan: api.Plan, rank: int) -> Counter:
    out: Counter = Counter()
    for t in plan.transfers:
        if t.src == rank:
            out[(t.kind, t.src, t.dst, t.bytes)] += t.count
    return out


def _rank(comm, p2p, plan, w, data, captured, local_gather: bool = True) -> tuple:
    tr = PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, p2p,
                         captured=captured, local_gather=local_gather)
    losses, per_step, sent = [], [], []
    for i, b in enumerate(data):
        start, start_p2p = len(comm.records), len(p2p.records)
        losses.append(tr.step(b, seed=i))
        per_step.append(record_counter(comm.records[start:]))
        sent.append(_sent(p2p.records[start_p2p:]))
    # Every collective a stage's ranks issued in a step is one its stage plan lists, and every
    # message a rank sent one the plan's transfers list (under autocast too: the plan sizes
    # each value at the dtype autocast computes it in, `cost/precision.py`).
    want = sum((plan_counter(plan.stages[s].plan) for s in tr.stages), Counter())
    assert all(step == want for step in per_step), (tr.stages, per_step[0] - want,
                                                    want - per_step[0])
    want_sent = _planned_sends(plan, p2p.rank)
    assert not local_gather or all(step == want_sent for step in sent), (
        p2p.rank, sent[0] - want_sent, want_sent - sent[0])
    return losses, tr.full_state_dict(), tr.mesh, tr.peak_held, sent[0]


@functools.cache
def _workload(spec: str) -> Workload:
    """The seeded workload; the Wide-ResNet in float64, as the single-stage tests train it:
    batch norm over a sample or two turns fp32 rounding into 1e-3 differences after a step.
    One per spec for the module: planning and training only read it, and meshplan's capture
    memo then traces it once per batch layout instead of once per case."""
    w = build_workload(spec, device="cpu", seed=0)
    if not spec.startswith("wresnet"):
        return w
    (x,), t = w.example_batch
    return Workload(copy.deepcopy(w.model).double(), w.loss_fn, ((x.double(),), t), w.name)


def _train(plan: api.Plan, spec: str, steps: int = 3) -> tuple[list[Any], Any, Any]:
    w = _workload(spec)
    data = batches(w, steps)
    if spec.startswith("wresnet"):
        data = [((x.double(),), t) for (x,), t in data]
    micro = split_microbatches(w.example_batch, plan.microbatches)[0]
    captured = capture(w.model, w.loss_fn, micro)
    meshes = plan.stage_meshes()
    return run_emulated_stages(_rank, meshes, plan, w, data, captured), w, data


@functools.cache
def _reference(spec: str, opt: OptimizerSpec, microbatches: int, dtype: str = "fp32",
               steps: int = 3) -> tuple[list[float], dict]:
    """The oracle on `_train`'s batches, once per spec, optimizer and micro-batch count."""
    w = _workload(spec)
    data = batches(w, steps)
    if spec.startswith("wresnet"):
        data = [((x.double(),), t) for (x,), t in data]
    return reference(w, opt, data, microbatches=microbatches, dtype=dtype)


CASES = [("megatron:dp=1,tp=1,pp=2", 2), ("megatron:dp=1,tp=2,pp=2", 4),
         ("megatron:dp=2,tp=1,pp=2", 4), ("megatron:dp=1,tp=2,pp=3", 6),
         ("megatron:dp=2,tp=2,pp=2", 8)]


def _check(spec: str, method: str, devices: int, schedule: str, microbatches: int,
           opt, cluster: str | None = None, **kw: Any) -> api.Plan:
    w = _workload(spec)
    plan = api.plan(w.model, w.loss_fn, opt, w.example_batch, cluster or f"local:{devices}",
                    method=method, dtype="fp32", memory_budget_gb=0,
                    microbatches=microbatches, schedule=schedule, name=spec, **kw)
    if kw.get("recompute") == "full":
        assert all(s.recompute and s.plan.recompute for s in plan.stages)
    meshes = int(method.split("pp=")[1][0])
    chunks = int(method.split("virtual=")[1][0]) if "virtual=" in method else 1
    assert (plan.num_meshes, plan.chunks, plan.schedule) == (meshes, chunks, schedule)
    results, w, data = _train(plan, spec)
    ref = _reference(spec, opt, microbatches)
    held_by_schedule = pipeline_program(plan).schedule.max_in_flight
    params: dict = {}
    for losses, state, mesh, held, _ in results:
        params.update(state)
        assert losses == pytest.approx(results[0][0], rel=1e-12)   # every rank reports it
        # The runtime's own count of micro-batches (times chunks) whose activations a mesh
        # holds: 1F1B's S - i, GPipe's every micro-batch, interleaving's warm-up + 1.
        bound = {"1f1b": min(meshes - mesh, microbatches), "gpipe": microbatches,
                 "interleaved": held_by_schedule(mesh)}[schedule]
        assert held == bound
    assert_matches((results[0][0], params, []), ref, plan, opt)
    return plan


def test_replicas_on_several_hosts_gather_host_by_host() -> None:
    """Stages of tensor parallelism over two hosts of two: each stage receives its replicated
    activations once into each host, whose two ranks gather them; the ranks move exactly the
    plan's messages and train equal to one device."""
    plan = _check(GPT, "megatron:dp=1,tp=4,pp=2", 8, "1f1b", 4, SGD,
                  cluster="p3.16xlarge:4x2")
    gathers = [t for t in plan.transfers if t.kind == "gather"]
    assert gathers and all(t.src // 2 == t.dst // 2 for t in gathers)


@pytest.mark.parametrize("method,devices,schedule",
                         [(m, d, "1f1b") for m, d in CASES] + [(m, d, "gpipe") for m, d in
                                                               (CASES[2], CASES[3])])
def test_mlp_pipelines_equal_one_device(method: str, devices: int, schedule: str) -> None:
    _check(MLP, method, devices, schedule, 4, SGD)


MLP12 = "mlp:layers=6,hidden=16,batch=12,bias=1"   # 6 micro-batches for 3 interleaved stages


@pytest.mark.parametrize("spec,method,devices,microbatches", [
    (MLP, "megatron:dp=1,tp=1,pp=2,virtual=3", 2, 4),
    (MLP, "megatron:dp=2,tp=1,pp=2,virtual=3", 4, 8),
    (MLP12, "megatron:dp=1,tp=2,pp=3,virtual=2", 6, 6)])
def test_interleaved_pipelines_equal_one_device(spec: str, method: str, devices: int,
                                                microbatches: int) -> None:
    """Interleaved 1F1B: each mesh runs several chunks; values between two chunks of one mesh
    stay on its ranks."""
    _check(spec, method, devices, "interleaved", microbatches, SGD)


@pytest.mark.parametrize("method,devices", CASES[1:4])
def test_gpt_pipelines_with_a_tied_embedding_equal_one_device(method: str, devices: int
                                                               ) -> None:
    """GPT's embedding is read by the first and the last stage: both copies get the summed
    gradient."""
    _check(GPT, method, devices, "1f1b", 4, SGD)


@pytest.mark.parametrize("schedule,microbatches", [("1f1b", 8), ("gpipe", 8),
                                                   ("interleaved", 8)])
def test_adamw_and_eight_micro_batches(schedule: str, microbatches: int) -> None:
    """Interleaved: 3 chunks per mesh, the tied embedding on chunk 0 (mesh 0) and the head on
    chunk 5 (mesh 1)."""
    virtual = ",virtual=3" if schedule == "interleaved" else ""
    _check(GPT, f"megatron:dp=1,tp=2,pp=2{virtual}", 4, schedule, microbatches, ADAMW)


def _gloo_rank(rank: int, nprocs: int, plans, spec: str, data) -> list[tuple]:
    from meshplan.runtime.comm import ProcessGroupComm
    from meshplan.runtime.p2p import ProcessGroupP2P
    out = []
    for plan in plans:
        w = build_workload(spec, device="cpu", seed=0)
        comm = ProcessGroupComm.for_stages(plan.stage_meshes())
        p2p = ProcessGroupP2P()
        tr = PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, p2p,
                             captured=cpu_capture(spec, plan.microbatches))
        losses = []
        for i, b in enumerate(data):
            start, start_p2p = len(comm.records), len(p2p.records)
            losses.append(tr.step(b, seed=i))
            want = sum((plan_counter(plan.stages[s].plan) for s in tr.stages), Counter())
            assert record_counter(comm.records[start:]) == want
            assert _sent(p2p.records[start_p2p:]) == _planned_sends(plan, rank)
        out.append((losses, tr.full_state_dict(), tr.mesh, tr.peak_held))
    return out


def test_real_gloo_processes(pool4) -> None:
    """Each schedule once on real processes: 4 gloo ranks, 2 stages of tensor parallelism (3
    chunks each when interleaved)."""
    meta = build_workload(GPT, device="meta")
    plans = [api.plan(meta.model, meta.loss_fn, SGD, meta.example_batch, "local:4",
                      method="megatron:dp=1,tp=2,pp=2", dtype="fp32", memory_budget_gb=0,
                      microbatches=4, schedule=schedule, name=GPT)
             for schedule in ("gpipe", "1f1b")]
    plans.append(api.plan(meta.model, meta.loss_fn, SGD, meta.example_batch, "local:4",
                          method="megatron:dp=1,tp=2,pp=2,virtual=3", dtype="fp32",
                          memory_budget_gb=0, microbatches=4, schedule="interleaved", name=GPT))
    w = build_workload(GPT, device="cpu", seed=0)
    data = batches(w, 3)
    per_rank = pool4.run(_gloo_rank, plans, GPT, data, timeout_s=300)
    ref = _reference(GPT, SGD, 4)
    for k, plan in enumerate(plans):
        params: dict = {}
        results = [r[k] for r in per_rank]
        schedule = pipeline_program(plan).schedule
        for losses, state, mesh, held in results:
            params.update(state)
            assert losses == results[0][0]
            assert held == {"1f1b": min(2 - mesh, 4), "gpipe": 4,
                            "interleaved": schedule.max_in_flight(mesh)}[plan.schedule]
        assert_matches((results[0][0], params, []), ref, plan, SGD)


WRN = "wresnet:layers=26,channels=4,width=1,image=8,classes=4,batch=16"  # 2 per rank
SLOW_SGD = OptimizerSpec("sgd", lr=0.01)
MOE = "moe:hidden=16,layers=2,heads=2,experts=4,seq=8,vocab=32,batch=8"


MOE4 = "moe:hidden=16,layers=4,heads=2,experts=4,seq=8,vocab=32,batch=8"


@pytest.mark.parametrize("spec,method,devices", [
    (WRN, "megatron:dp=1,tp=1,pp=2", 2), (WRN, "megatron:dp=2,tp=1,pp=2", 4),
    (MOE, "megatron:dp=1,tp=1,pp=2", 2), (MOE, "megatron:dp=1,tp=2,pp=2", 4),
    (WRN, "megatron:dp=1,tp=1,pp=2,virtual=2", 2),
    (MOE4, "megatron:dp=1,tp=2,pp=2,virtual=2", 4)])
def test_wide_resnet_and_moe_pipelines_equal_one_device(spec: str, method: str,
                                                        devices: int) -> None:
    """Wide-ResNet (batch norm, convolutions, skips) and the MoE transformer (all-to-all
    dispatch inside stages), under 1F1B and interleaved. Wide-ResNet at lr 0.01 in float64,
    as the single-stage tests train it."""
    schedule = "interleaved" if "virtual" in method else "1f1b"
    layers = {"num_layers": 4} if spec == MOE4 else {}
    _check(spec, method, devices, schedule, 4, SLOW_SGD if spec == WRN else SGD, **layers)


def test_recomputed_stages_equal_one_device() -> None:
    """Every stage recomputed (its forward rerun inside its backward): the same numbers."""
    _check(GPT, "megatron:dp=1,tp=2,pp=2", 4, "1f1b", 4, SGD, recompute="full")


def test_bf16_pipeline_equals_single_device_autocast() -> None:
    """bf16 autocast, against one device under the same autocast, with the single-stage
    runtime's bounds (`test_training_step.test_mixed_precision_equals_single_device_autocast`):
    losses within 4u, parameters within 32u of the update's norm, u = 2^-8. Values cross
    stages in the dtype their last op made, so the pipeline rounds where one device does."""
    w = _workload(GPT)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4",
                    method="megatron:dp=1,tp=2,pp=2", dtype="bf16", memory_budget_gb=0,
                    microbatches=4, name=GPT)
    results, w, data = _train(plan, GPT)
    losses, ref = _reference(GPT, SGD, 4, "bf16")
    u = 2.0 ** -8
    init = dict(w.model.named_parameters())

    def norm(d: dict) -> float:
        return sum(v.double().pow(2).sum() for v in d.values()).sqrt().item()

    params: dict = {}
    for _, state, _, _, _ in results:
        params.update(state)
    update = norm({k: ref[k] - init[k].detach() for k in ref})
    got = results[0][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, losses)) <= 4 * u, (got, losses)
    assert norm({k: params[k] - ref[k] for k in ref}) <= 32 * u * update


@pytest.mark.parametrize("spec,method,devices", [(GPT, "megatron:dp=1,tp=2,pp=2", 4),
                                                 (MLP, "megatron:dp=2,tp=1,pp=3", 6),
                                                 (GPT, "megatron:dp=1,tp=1,pp=2,virtual=3", 2)])
def test_global_norm_clipping_spans_stages(spec: str, method: str, devices: int) -> None:
    """The clipping norm sums every stage's gradients (a tied embedding counted once; under
    interleaving a mesh adds its chunks' norms first)."""
    clipped = OptimizerSpec("sgd", lr=0.1, max_grad_norm=0.05)
    schedule = "interleaved" if "virtual" in method else "1f1b"
    _check(spec, method, devices, schedule, 4, clipped)


def _fault_case() -> tuple[api.Plan, list]:
    """The 2-stage, tensor-parallel MLP plan on 4 processes the fault tests break, 2 batches."""
    meta = build_workload(MLP, device="meta")
    plan = api.plan(meta.model, meta.loss_fn, SGD, meta.example_batch, "local:4",
                    method="megatron:dp=1,tp=2,pp=2", dtype="fp32", memory_budget_gb=0,
                    microbatches=4, name=MLP)
    return plan, batches(build_workload(MLP, device="cpu", seed=0), 2)


def _gloo_trainer(plan, spec: str) -> PipelineTrainer:
    """A rank's PipelineTrainer in a launched gloo world."""
    from meshplan.runtime.comm import ProcessGroupComm
    from meshplan.runtime.p2p import ProcessGroupP2P
    w = build_workload(spec, device="cpu", seed=0)
    comm = ProcessGroupComm.for_stages(plan.stage_meshes())
    return PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, ProcessGroupP2P())


def _pipeline_rank_dies(rank: int, nprocs: int, plan, spec: str, data, how: str) -> None:
    import os
    import signal
    tr = _gloo_trainer(plan, spec)
    tr.step(data[0])
    if rank == 2:   # a rank of the last stage, while the first stage waits on its gradients
        if how == "raise":
            raise RuntimeError("stage 1 rank breaks its step")
        os.kill(os.getpid(), signal.SIGKILL)
    tr.step(data[1])


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_pipeline_rank_ends_the_run_fast(how: str) -> None:
    """A rank that raises or is killed mid-pipeline: the launcher stops every process and
    names the rank within 60 s (the other stage is blocked receiving from it)."""
    import time
    from meshplan.errors import WorkerError
    from meshplan.runtime.launcher import launch
    plan, data = _fault_case()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_pipeline_rank_dies, 4, (plan, MLP, data, how), timeout_s=120)
    assert info.value.rank == 2
    expected = "breaks its step" if how == "raise" else "signal 9"
    assert expected in str(info.value)
    assert time.monotonic() - start < 60


def _pipeline_rank_hangs(rank: int, nprocs: int, plan, spec: str, data) -> None:
    import time
    tr = _gloo_trainer(plan, spec)
    tr.step(data[0])
    if rank == 3:
        time.sleep(600)   # stuck: its stage peer and the other stage wait on it
    tr.step(data[1])


def test_a_hung_pipeline_rank_is_named_with_no_progress() -> None:
    """A rank that stops making progress: its peers' receives and collectives time out after
    the launch's collective timeout, and the launcher names the silent rank."""
    import time
    from meshplan.errors import WorkerError
    from meshplan.runtime.launcher import launch
    plan, data = _fault_case()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_pipeline_rank_hangs, 4, (plan, MLP, data), timeout_s=120,
               collective_timeout_s=5)
    assert info.value.rank == 3
    assert "no progress for 5 s" in str(info.value)
    assert time.monotonic() - start < 60


class _SharedBlock(nn.Module):
    """One block applied four times (ALBERT's cross-layer sharing): under 2 meshes x 2 chunks
    every chunk holds it, two of them on the same ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in range(4):   # a different weight expression per layer: no op is shared
            h = h + torch.tanh(h @ (self.block.weight * (1.0 + 0.1 * i)).T)
        return self.out(h)


@pytest.mark.parametrize("method,devices", [("megatron:dp=1,tp=1,pp=2,virtual=2", 2),
                                            ("megatron:dp=1,tp=2,pp=2,virtual=2", 4)])
def test_a_parameter_shared_by_chunks_of_one_mesh(method: str, devices: int) -> None:
    """A parameter every chunk reads, two chunks per mesh: each copy takes the gradient summed
    over all four chunks (the parts of a rank's own chunks pass through its local box)."""
    model = _SharedBlock()
    example = ((torch.randn(16, 8),), torch.randint(0, 4, (16,)))
    w = Workload(model, nn.CrossEntropyLoss(), example, "shared-block")
    plan = api.plan(model, w.loss_fn, SGD, example, f"local:{devices}", method=method,
                    dtype="fp32", memory_budget_gb=0, microbatches=4, num_layers=4,
                    schedule="interleaved", name="shared-block")
    holders = [s.index for s in plan.stages if any(p.name == "block.weight"
                                                   for p in s.plan.params)]
    assert holders == [0, 1, 2, 3]
    _trains_like_one_device(plan, w, SGD)


def _trains_like_one_device(plan: api.Plan, w: Workload, opt: OptimizerSpec) -> None:
    """Three steps of ``plan`` on emulated ranks equal one device's (a workload of the test's
    own model, not a zoo spec)."""
    data = batches(w, 3)
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                              plan.microbatches)[0])
    results = run_emulated_stages(_rank, plan.stage_meshes(), plan, w, data, captured)
    params: dict = {}
    for _, state, _, _, _ in results:
        params.update(state)
    assert_matches((results[0][0], params, []),
                   reference(w, opt, data, microbatches=plan.microbatches), plan, opt)


def test_local_all_gather_moves_fewer_bytes_between_meshes() -> None:
    """The same plan run with and without Alpa's local all-gather: both equal one device, and
    the bytes recorded crossing between the two meshes (tensor parallel, so the receiving
    ranks replicate the activations) are fewer with it; the gathers stay inside a mesh."""
    w = _workload(GPT)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4",
                    method="megatron:dp=1,tp=2,pp=2", dtype="fp32", memory_budget_gb=0,
                    microbatches=4, name=GPT)
    data = batches(w, 3)
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch, 4)[0])
    ref = _reference(GPT, SGD, 4)
    mesh = {r: m for m, (_, ranks) in enumerate(plan.stage_meshes()) for r in ranks}
    crossing = {}
    for lg in (True, False):
        results = run_emulated_stages(_rank, plan.stage_meshes(), plan, w, data, captured, lg)
        params: dict = {}
        for _, state, _, _, _ in results:
            params.update(state)
        assert_matches((results[0][0], params, []), ref, plan, SGD)
        sent = sum((r[4] for r in results), Counter())
        crossing[lg] = sum(n * b for (kind, src, dst, b), n in sent.items()
                           if mesh[src] != mesh[dst])
        assert all(mesh[src] == mesh[dst] for (kind, src, dst, _) in sent if kind == "gather")
    assert 0 < crossing[True] < crossing[False]


class _ParameterFreeTail(nn.Module):
    """A linear layer, then as many FLOPs again in ops without parameters (products of the
    activations with themselves): a pipeline of two stages gives the second nothing to
    update."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))                    # (B, 16, 16)
        for _ in range(3):
            h = torch.tanh(h @ h.transpose(-1, -2) / 4)
        return h.mean(dim=(1, 2))


@pytest.mark.parametrize("opt", [ADAMW, OptimizerSpec("adamw", lr=1e-2, max_grad_norm=0.05),
                                 OptimizerSpec("adafactor", lr=1e-2)],
                         ids=["adamw", "clipped", "adafactor"])
@pytest.mark.parametrize("method,devices", [("megatron:dp=1,tp=1,pp=2", 2),
                                            ("megatron:dp=2,tp=1,pp=2", 4)])
def test_a_stage_without_parameters_trains(opt: OptimizerSpec, method: str, devices: int
                                           ) -> None:
    """A stage that holds no parameter (a loss's last ops, a head of pooling) steps an
    optimizer over nothing, and adds nothing to the clipping norm: the pipeline equals one
    device (torch refuses an optimizer of an empty parameter list)."""
    model = _ParameterFreeTail()
    example = ((torch.randn(8, 16, 16),), torch.randn(8))
    w = Workload(model, nn.MSELoss(), example, "free-tail")
    plan = api.plan(model, w.loss_fn, opt, example, f"local:{devices}", method=method,
                    dtype="fp32", memory_budget_gb=0, microbatches=2, num_layers=2,
                    name="free-tail")
    assert [len(s.plan.params) for s in plan.stages] == [2, 0]
    _trains_like_one_device(plan, w, opt)


def _many(comm, p2p, plan, model, batch) -> tuple:
    tr = PipelineTrainer(plan, copy.deepcopy(model), nn.functional.mse_loss, batch, comm, p2p)
    return tr.step(batch), tr.whole_state()


def test_more_micro_batches_than_a_fixed_tag_field_held() -> None:
    """A step's messages are tagged by fields as wide as the pipeline needs: 1,100
    micro-batches (the tags held 1,024 before), the step one device's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    batch = ((torch.randn(1100, 4, generator=g),), torch.randn(1100, 2, generator=g))
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    loss = nn.functional.mse_loss(one(batch[0][0]), batch[1])
    loss.backward()
    opt.step()
    plan = api.plan(model, nn.functional.mse_loss, OptimizerSpec("sgd", lr=0.1), batch,
                    "local:2", method="megatron:dp=1,tp=1,pp=2", microbatches=1100,
                    memory_budget_gb=0,
                    dtype="fp32")
    for got, state in run_emulated_stages(_many, plan.stage_meshes(), plan, model, batch,
                                          timeout_s=300):
        assert got == pytest.approx(loss.item(), rel=1e-6)
        for name, value in one.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
