"""Batches the plan was not made for (issue 26.1): refused on every rank with one clear message
before any rank communicates, after which the ranks go on in step. The issue's run: a data plan
of a GPT on 2 gloo processes given a batch of the planned shape, one with a shorter sequence
and one of fewer sequences — the last used to desynchronize the ranks into a 30 s timeout."""

from __future__ import annotations

import math
import time

import pytest
import torch

from meshplan.capture.batch import check_shapes
from oracle import make_plan, SGD
from user_loop import parallel, train_steps
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"


def _batch(w, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    return ((ids,), torch.randint(0, 128, (batch, seq), generator=g))


def _rank(rank: int, nprocs: int, plan) -> list:
    w = build_workload(GPT, device="cpu", seed=0)
    model, opt, sched = parallel(w, plan)
    out = [train_steps(model, opt, sched, [_batch(w, 8, 16, 0)])]
    for batch, seq in ((8, 12), (6, 16)):
        t0 = time.perf_counter()
        try:
            model(_batch(w, batch, seq, 1))
            out.append(("ran", batch, seq))
        except ValueError as e:
            out.append((str(e), time.perf_counter() - t0))
    out.append(train_steps(model, opt, sched, [_batch(w, 8, 16, 2)]))   # still in step
    return out


def test_a_batch_of_another_shape_is_refused_on_every_rank_at_once(pool2) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD)
    results = pool2.run(_rank, plan)
    for first, short, few, after in results:
        for message, seconds in (short, few):   # at once: no collective waited on
            assert "make a plan" in message and seconds < 5, (message, seconds)
        assert "input0: planned [8, 16], given [8, 12]" in short[0]
        assert "input0: planned [8, 16], given [6, 16]" in few[0]
    # The ranks are still in step: the next planned batch trains on both alike.
    assert results[0][0] == results[1][0] and results[0][3] == results[1][3]
    assert math.isfinite(results[0][3][0])


def test_the_message_names_each_tensor_planned_and_given() -> None:
    example = ((torch.zeros(8, 16, dtype=torch.long),), torch.zeros(8, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input0: planned \[8, 16\], given \[8, 12\]"):
        check_shapes({"input0": (8, 16), "target": (8, 16)},
                     ((torch.zeros(8, 12),), torch.zeros(8, 12)))
    check_shapes({"input0": (8, 16), "target": (8, 16)}, example)   # the planned shape runs
