"""Every batch shape a loader gives (issue 26.1): a plan serves batch sizes and sequence
lengths other than its example's — its decisions lowered again on the program traced at each
new shape, once per shape — equal to one device step by step; a batch it cannot serve is
refused on every rank with one clear message before any rank communicates, and the ranks go
on in step."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

import meshplan.api as api
from meshplan.capture.batch import check_shapes
from meshplan.runtime.emulated import run_emulated, run_emulated_stages
from meshplan.runtime.optim import make_optimizer
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.zoo.spec import Workload, build_workload
import test_hf_models as hf
from oracle import SGD, assert_matches, make_plan
from user_loop import one_device, parallel, train_steps

# Dynamic padding: every batch padded to its own longest row, the last batch of the epoch short
# (rows, sequence length); one batch square (rows = length), where equal sizes once traced to
# another program.
SHAPES = [(4, 8), (4, 12), (6, 5), (8, 8), (4, 9)]


def _padded(seed: int, rows: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf.VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1, -min(3, seq - 1):] = 0      # a shorter row, padded
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


_DATA = [_padded(s, r, q) for s, (r, q) in enumerate(SHAPES)]
_MODEL = hf.build("llama")


def _one_device() -> tuple[list[float], dict]:
    model = copy.deepcopy(_MODEL)
    opt = make_optimizer(SGD, model.parameters())
    losses = []
    for b in _DATA:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


_REF: list = []


def _ref() -> tuple[list[float], dict]:
    if not _REF:
        _REF.append(_one_device())
    return _REF[0]


def _shaped_rank(comm, plan, w, data) -> tuple:
    from meshplan.runtime.trainer import Trainer
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
    return [tr.step(b) for b in data], tr.full_state_dict()


@pytest.mark.parametrize("method,shape,microbatches", [
    ("data", (1, 2), 1), ("megatron", (1, 2), 2), ("zero3", (1, 2), 2), ("auto", (2, 2), 1)])
def test_dynamically_padded_batches_equal_one_device(method: str, shape, microbatches) -> None:
    extra = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
    plan = api.plan(_MODEL, None, SGD, _DATA[0], f"local:{math.prod(shape)}", mesh_shape=shape,
                    method=method, memory_budget_gb=0, microbatches=microbatches, **extra)
    w = Workload(_MODEL, None, _DATA[0], "llama")
    for losses, params in run_emulated(_shaped_rank, shape, plan, w, _DATA):
        # Step by step: every loss, then the parameters after the five steps.
        assert_matches((losses, params, []), _ref(), plan, SGD)


def _pipeline_rank(comm, p2p, plan, data) -> tuple:
    tr = PipelineTrainer(plan, _MODEL, None, data[0], comm, p2p)
    return [tr.step(b, seed=i) for i, b in enumerate(data)], tr.full_state_dict()


@pytest.mark.parametrize("method,devices,microbatches", [
    ("megatron:dp=1,tp=1,pp=2", 2, 2), ("megatron:dp=2,tp=1,pp=2", 4, 1)])
def test_a_two_stage_pipeline_serves_every_shape(method: str, devices: int,
                                                 microbatches: int) -> None:
    plan = api.plan(_MODEL, None, SGD, _DATA[0], f"local:{devices}", method=method,
                    memory_budget_gb=0, microbatches=microbatches, dtype="fp32")
    results = run_emulated_stages(_pipeline_rank, plan.stage_meshes(), plan, _DATA)
    params: dict = {}
    for _, state in results:
        params.update(state)
    assert_matches((results[0][0], params, []), _ref(), plan, SGD)


# ---------------------------------------------------------------- the issue's run, on gloo

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"


def _batch(batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    return ((ids,), torch.randint(0, 128, (batch, seq), generator=g))


ISSUE = [_batch(8, 16, 0), _batch(8, 12, 1), _batch(6, 16, 2)]


def _gloo_rank(rank: int, nprocs: int, plan) -> list:
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, sched = parallel(w, plan)
    return train_steps(model, opt, sched, ISSUE)


def test_the_issue_batches_train_on_gloo_as_on_one_device(pool2) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD)
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), ISSUE)
    for losses in pool2.run(_gloo_rank, plan):
        assert losses == pytest.approx(ref, rel=1e-5)


def _refusing_rank(rank: int, nprocs: int, plan) -> list:
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, sched = parallel(w, plan)
    out: list = [train_steps(model, opt, sched, [_batch(8, 16, 0)])]
    for rows in (3, 2):   # micro-batches that do not divide it; micro-batches of one sample
        t0 = time.perf_counter()
        try:
            model(_batch(rows, 16, 1))
            out.append(("ran", rows))
        except ValueError as e:
            out.append((str(e), time.perf_counter() - t0))
    out.append(train_steps(model, opt, sched, [_batch(8, 16, 2)]))   # still in step
    return out


def test_a_batch_it_cannot_serve_is_refused_on_every_rank_at_once(pool2) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD, microbatches=2)
    results = pool2.run(_refusing_rank, plan)
    for first, odd, single, after in results:
        for message, seconds in (odd, single):   # at once: no collective waited on
            assert seconds < 5, (message, seconds)
        assert "2 micro-batches do not divide the batch of 3" in odd[0]
        assert "micro-batches of 1 sample(s), the plan's hold 4" in single[0]
    # The ranks are still in step: the next batch trains on both alike.
    assert results[0][0] == results[1][0] and results[0][3] == results[1][3]
    assert math.isfinite(results[0][3][0])


def test_a_pipeline_stage_alone_runs_its_planned_shape() -> None:
    with pytest.raises(ValueError, match=r"input0: planned \[8, 16\], given \[8, 12\]"):
        check_shapes({"input0": (8, 16), "target": (8, 16)},
                     ((torch.zeros(8, 12),), torch.zeros(8, 12)))
    check_shapes({"input0": (8, 16), "target": (8, 16)},
                 ((torch.zeros(8, 16),), torch.zeros(8, 16)))


# ---------------------------------------------------------------- what a new shape costs

def _recorded_rank(comm, plan, w, data) -> list:
    from meshplan.runtime.trainer import Trainer
    from oracle import record_counter
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
    out = []
    for b in data:
        start = len(comm.records)
        tr.step(b)
        out.append(record_counter(comm.records[start:]))
    return out


@pytest.mark.parametrize("method,shape,microbatches,recompute", [
    ("data", (1, 2), 1, "none"), ("megatron", (1, 2), 2, "full"), ("zero3", (1, 2), 2, "none"),
    ("auto", (2, 2), 1, "none")])
def test_the_plan_priced_at_a_new_shape_lists_what_runs_there(
        method: str, shape, microbatches: int, recompute: str) -> None:
    from meshplan.planner.intra.at_shape import at_shape
    from meshplan.sim.simulate import simulate
    from oracle import plan_counter
    plan = api.plan(_MODEL, None, SGD, _DATA[0], f"local:{math.prod(shape)}", mesh_shape=shape,
                    method=method, memory_budget_gb=0, microbatches=microbatches,
                    recompute=recompute)
    same = at_shape(plan, _MODEL, None, _DATA[0])   # at its own shape: the plan itself
    assert same.collectives == plan.collectives
    assert same.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"],
                                                          rel=1e-12)
    longer = at_shape(plan, _MODEL, None, _DATA[3])   # (8, 8): twice the rows
    assert longer.predicted["step_time_s"] > plan.predicted["step_time_s"]
    assert simulate(longer).step_time_s > 0
    w = Workload(_MODEL, None, _DATA[0], "llama")
    for per_step in run_emulated(_recorded_rank, shape, plan, w, [_DATA[0], _DATA[3]]):
        assert per_step[0] == plan_counter(plan)
        assert per_step[1] == plan_counter(longer)   # the new shape's program, as priced


def _recorded_pipeline_rank(comm, p2p, plan, data) -> list:
    from collections import Counter
    from oracle import record_counter
    tr = PipelineTrainer(plan, _MODEL, None, data[0], comm, p2p)
    out = []
    for i, b in enumerate(data):
        start, sent = len(comm.records), len(p2p.records)
        tr.step(b, seed=i)
        out.append((tr.stages, record_counter(comm.records[start:]),
                    Counter((r.kind, r.src, r.dst, r.nbytes) for r in p2p.records[sent:]
                            if r.kind in ("activation", "gradient", "gather", "tied"))))
    return out


@pytest.mark.parametrize("method,devices,microbatches,recompute", [
    ("megatron:dp=1,tp=2,pp=2", 4, 2, "none"), ("megatron:dp=2,tp=1,pp=2", 4, 1, "full")])
def test_a_pipeline_priced_at_a_new_shape_lists_what_runs_there(
        method: str, devices: int, microbatches: int, recompute: str) -> None:
    from collections import Counter
    from meshplan.planner.intra.at_shape import at_shape
    from meshplan.sim.simulate import simulate
    from oracle import plan_counter
    plan = api.plan(_MODEL, None, SGD, _DATA[0], f"local:{devices}", method=method,
                    memory_budget_gb=0, microbatches=microbatches, dtype="fp32",
                    recompute=recompute)
    same = at_shape(plan, _MODEL, None, _DATA[0])   # at its own shape: the plan itself
    assert same.transfers == plan.transfers
    for a, b in zip(plan.stages, same.stages):
        assert (b.latency_s, b.memory_bytes) == pytest.approx((a.latency_s, a.memory_bytes),
                                                              rel=1e-12)
    assert same.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"],
                                                          rel=1e-12)
    longer = at_shape(plan, _MODEL, None, _DATA[3])   # (8, 8): twice the rows
    assert longer.predicted["step_time_s"] > plan.predicted["step_time_s"]
    assert longer.predicted["peak_memory_bytes"] > plan.predicted["peak_memory_bytes"]
    assert simulate(longer).step_time_s > simulate(plan).step_time_s
    results = run_emulated_stages(_recorded_pipeline_rank, plan.stage_meshes(), plan,
                                  [_DATA[0], _DATA[3]])
    for rank, per_step in enumerate(results):
        for priced, (stages, collectives, sent) in zip((plan, longer), per_step):
            assert collectives == sum((plan_counter(priced.stages[s].plan) for s in stages),
                                      Counter())
            want: Counter = Counter()
            for t in priced.transfers:
                if t.src == rank:
                    want[(t.kind, t.src, t.dst, t.bytes)] += t.count
            assert sent == want
