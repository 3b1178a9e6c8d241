"""A failing step never desynchronizes the world (issue 26.2): an exception on one rank inside
a step — in its forward, its backward, while gradients are synchronized — becomes the same
`StepFailed` on every rank at once (no collective waits out its timeout), the step is undone
on every rank, and the run goes on: equal to one device trained without that batch. A failure
once the update has begun is reported alike and the run refuses to go on."""

from __future__ import annotations

import time

import pytest
import torch

import meshplan.api as api
from meshplan.errors import StepFailed, WorkerError
from meshplan.runtime.launcher import launch
from meshplan.zoo.spec import build_workload
from oracle import ADAMW, SGD, assert_matches, cpu_capture, make_plan
from user_loop import one_device, parallel

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
FAILS_AT = 1          # the step that fails, on rank 1
MESSAGE = "injected: CUDA out of memory. Tried to allocate 2.00 GiB"


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    return ((ids,), torch.randint(0, 128, (8, 16), generator=g))


DATA = [_batch(s) for s in range(4)]


def _arm(model, opt, where: str) -> dict:
    """On this rank, the next step armed fails ``where``: at its first collective or transfer
    of that phase ("forward", "backward", "update": the gradients' synchronization and the
    loss's report), or in the optimizer's update ("update_begun")."""
    armed = {"on": False}
    if where == "update_begun":
        def boom(*_):
            if armed["on"]:
                armed["on"] = False
                raise torch.OutOfMemoryError(MESSAGE)
        opt.register_step_pre_hook(boom)   # after meshplan's: the update has begun
        return armed
    engine = model._pipeline or model._trainer
    comm = next(iter(engine.trainers.values())).comm if model._pipeline else engine.comm
    begin = comm._begin

    def failing_begin(t, axes, phase):
        if armed["on"] and phase == where:
            armed["on"] = False
            raise torch.OutOfMemoryError(MESSAGE)
        return begin(t, axes, phase)
    comm._begin = failing_begin
    if model._pipeline is not None:   # a pipeline's stages talk by transfers too
        send, kind = model._pipeline.p2p.send, {"forward": "activation",
                                                "backward": "gradient"}.get(where)

        def failing_send(t, dst, tag, k=""):
            if armed["on"] and k == kind:
                armed["on"] = False
                raise torch.OutOfMemoryError(MESSAGE)
            return send(t, dst, tag, k)
        model._pipeline.p2p.send = failing_send
    return armed


def _rank(rank: int, nprocs: int, plan, where: str) -> tuple:
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, sched = parallel(w, plan, captured=cpu_capture(GPT, plan.microbatches))
    losses, failures, armed = [], [], None
    for i, b in enumerate(DATA):
        if i == FAILS_AT and rank == 1:
            armed["on"] = True
        t0 = time.perf_counter()
        try:
            loss = model(b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
        except StepFailed as e:
            failures.append((i, e.rank, e.step, e.error_type, e.message, e.recoverable,
                             time.perf_counter() - t0, str(e)))
        except RuntimeError as e:   # a run that cannot go on refuses every later step
            failures.append((i, str(e)))
        if armed is None:
            armed = _arm(model, opt, where)
    return losses, failures, model.full_state_dict()


def _check_same_failure(results: list, recoverable: bool = True) -> None:
    assert all(len(r[1]) == 1 for r in results), [r[1] for r in results]
    failures = [r[1][0] for r in results]
    for i, origin, step, kind, message, ok, seconds, text in failures:
        assert (i, origin, step, kind, message, ok) == \
            (FAILS_AT, 1, FAILS_AT, "OutOfMemoryError", MESSAGE, recoverable)
        assert seconds < 5, seconds   # the collective timeout is 30 s: none waited out
        assert "step 1 failed on rank 1: OutOfMemoryError: injected" in text
        assert "traceback of rank 1" in text
    assert len({f[-1] for f in failures}) == 1   # the same error on every rank


def _check_goes_on(results: list, plan) -> None:
    """Every rank went on in step: equal to one device trained without the failed batch (the
    loop's AdamW, at the oracle's tolerance for it)."""
    ref = one_device(build_workload(GPT, device="cpu", seed=0),
                     [b for i, b in enumerate(DATA) if i != FAILS_AT])
    params: dict = {}
    for losses, failures, state in results:
        assert len(failures) == 1 and len(losses) == len(DATA) - 1
        assert losses == results[0][0]   # in step: every rank reports the same loss
        params.update(state)
    assert_matches((results[0][0], params, []), ref, plan, ADAMW)


@pytest.mark.parametrize("method,microbatches,where", [
    ("data", 2, "update"), ("megatron", 2, "forward"), ("megatron", 1, "backward"),
    ("zero3", 2, "backward")])
def test_a_step_failing_on_one_rank_fails_alike_on_both_and_the_run_goes_on(
        pool2, method: str, microbatches: int, where: str) -> None:
    # "update": the gradients' synchronization before the optimizer's step (its collectives'
    # phase), the update itself not begun; "backward" inside the caller's loss.backward().
    plan = make_plan(GPT, (1, 2), method, SGD, microbatches=microbatches)
    results = pool2.run(_rank, plan, where)
    _check_same_failure(results)
    _check_goes_on(results, plan)


@pytest.mark.parametrize("method,where", [("auto", "update"),
                                          ("megatron:dp=2,tp=1,pp=2", "forward"),
                                          ("megatron:dp=1,tp=2,pp=2", "backward")])
def test_on_four_processes_and_across_pipeline_stages(pool4, method: str, where: str) -> None:
    w = build_workload(GPT, device="meta", seed=0)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4", method=method,
                    memory_budget_gb=0, microbatches=2, dtype="fp32") \
        if method.startswith("megatron:") else make_plan(GPT, (2, 2), method, SGD)
    results = pool4.run(_rank, plan, where)
    _check_same_failure(results)
    _check_goes_on(results, plan)


def test_a_failure_after_the_update_began_stops_the_run_on_every_rank(pool2) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD)
    results = pool2.run(_rank, plan, "update_begun")
    for rank, (losses, failures, _) in enumerate(results):
        first, *later = failures
        # Rank 0 may finish step 1 (its update is its own) and learn of it in step 2.
        assert first[0] == len(losses) and first[0] in ((FAILS_AT,) if rank else (1, 2))
        assert first[1:4] == (1, FAILS_AT, "OutOfMemoryError") and first[5] is False
        assert first[6] < 5
        assert "the ranks' parameters may differ: restore the last checkpoint" in first[-1]
        assert [f[0] for f in later] == list(range(first[0] + 1, len(DATA)))
        assert all("this run cannot go on" in f[1] for f in later)   # refused, every step


def _raising_rank(rank: int, nprocs: int) -> None:
    plan = make_plan(GPT, (1, 2), "megatron", SGD)
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, sched = parallel(w, plan)
    for i, b in enumerate(DATA):
        if i == FAILS_AT:
            _arm(model, opt, "backward")["on"] = rank == 1
        model(b).backward()
        opt.step()
        opt.zero_grad()


def test_under_launch_the_run_stops_with_the_ranks_own_error() -> None:
    t0 = time.perf_counter()
    with pytest.raises(WorkerError) as info:
        launch(_raising_rank, 2, collective_timeout_s=30)
    assert info.value.rank == 1
    assert info.value.message.startswith("OutOfMemoryError: injected")
    assert "failing_begin" in info.value.traceback
    assert time.perf_counter() - t0 < 25
