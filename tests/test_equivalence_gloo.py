"""Every plan family once over real gloo processes (the session's worker pools, `conftest.py`)."""

from __future__ import annotations

import time

import pytest

from meshplan.errors import WorkerError
from meshplan.runtime.comm import ProcessGroupComm
from meshplan.runtime.launcher import launch
from meshplan.runtime.pool import WorkerPool
from meshplan.zoo.spec import build_workload
from oracle import (ADAMW, GPT, MLP, SGD, assert_matches, batches, cpu_capture, make_plan,
                    seeded_run, train_rank)


def _train(rank: int, nprocs: int, plan, spec: str, data) -> tuple:
    comm = ProcessGroupComm(plan.mesh_shape)
    assert comm.rank == rank and plan.num_devices == nprocs
    return train_rank(comm, plan, build_workload(spec, device="cpu", seed=0), data,
                      cpu_capture(spec, plan.microbatches))


def _check(pool: WorkerPool, spec: str, shape, method: str, opt, **kw) -> None:
    plan = make_plan(spec, shape, method, opt, **kw)
    _, data, ref = seeded_run(spec, opt)
    for result in pool.run(_train, plan, spec, data):
        assert_matches(result, ref, plan, opt)


@pytest.mark.parametrize("spec,method,opt,kw", [
    (GPT, "data", SGD, {}),
    (MLP, "zero2", ADAMW, {}),
    (MLP, "data", SGD, {"axis_weights": ((1.0,), (3.0, 1.0))}),
], ids=["gpt-data", "mlp-zero2-adamw", "mlp-uneven-3to1"])
def test_two_processes(pool2, spec, method, opt, kw) -> None:
    _check(pool2, spec, (1, 2), method, opt, **kw)


MOE = "moe:hidden=32,layers=2,heads=4,experts=4,seq=16,vocab=64,batch=4"
VGG = "vgg19:channels=8,fc=64,image=32,classes=10,batch=8"


@pytest.mark.parametrize("spec,shape,method,opt,kw", [
    (MOE, (1, 4), "auto", SGD, {"abstract": True}),     # expert parallel: all-to-all over gloo
    (VGG, (1, 4), "heuristic", SGD, {}),
    (GPT, (1, 4), "megatron", SGD, {}),
    (GPT, (2, 2), "megatron", ADAMW, {}),
    (MLP, (1, 4), "zero3", SGD, {}),
    (GPT, (2, 2), "auto", SGD, {"abstract": True}),
], ids=["moe-ilp", "vgg-heuristic", "gpt-megatron", "gpt-dp-x-tp-adamw", "mlp-zero3",
        "gpt-ilp"])
def test_four_processes(pool4, spec, shape, method, opt, kw) -> None:
    _check(pool4, spec, shape, method, opt, **kw)


def _dies_mid_step(rank: int, nprocs: int, plan, spec: str, data) -> None:
    from meshplan.runtime.trainer import Trainer
    comm = ProcessGroupComm(plan.mesh_shape)
    w = build_workload(spec, device="cpu", seed=0)
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
    for step, b in enumerate(data):
        if rank == 1 and step == 1:
            def boom() -> None:
                raise ValueError("rank 1 breaks its optimizer in step 1")
            tr.optimizer.step = boom  # fails after backward, while rank 0 runs on
        tr.step(b)


def test_a_rank_that_raises_mid_step_ends_the_run_fast() -> None:
    plan = make_plan(MLP, (1, 2), "data", SGD)
    data = batches(build_workload(MLP, device="cpu", seed=0), 4)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_dies_mid_step, 2, (plan, MLP, data))
    assert info.value.rank == 1
    assert "breaks its optimizer" in str(info.value)
    assert time.monotonic() - start < 60


_FAILING_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from oracle import MLP, SGD, batches, make_plan
from meshplan.runtime.launcher import launch
from meshplan.zoo.spec import build_workload
from test_equivalence_gloo import _dies_mid_step
if __name__ == "__main__":
    plan = make_plan(MLP, (1, 2), "data", SGD)
    launch(_dies_mid_step, 2, (plan, MLP, batches(build_workload(MLP, device="cpu"), 4)))
"""


def test_a_script_whose_rank_raises_exits_non_zero_with_that_error(tmp_path) -> None:
    import os
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(_FAILING_SCRIPT.format(tests=os.path.dirname(__file__)))
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode != 0
    assert "rank 1 failed" in out.stderr and "breaks its optimizer" in out.stderr
    assert time.monotonic() - start < 60
