"""Checkpoints (issue 11, item 3): saved under one plan and resumed under another — data
parallel, ZeRO-3, Megatron tensor parallel, a 2-stage pipeline, every ordered pair — the
training goes on exactly as if never stopped, and the checkpoint loads into the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.zoo.spec import build_workload
from checkpoint_cases import resume_and_train
from oracle import batches
from user_loop import one_device

SPEC = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"   # a tied embedding
PLANS = {
    "data": dict(mesh_shape=(1, 4), method="data"),
    "zero3": dict(mesh_shape=(2, 2), method="zero3"),
    "megatron": dict(mesh_shape=(2, 2), method="megatron"),
    "pipeline": dict(method="megatron:dp=1,tp=2,pp=2", microbatches=2),
}
# Consecutive entries cover every ordered pair of plans once.
ORDER = ["data", "zero3", "megatron", "pipeline", "data", "megatron", "zero3", "pipeline",
         "megatron", "data", "pipeline", "zero3", "data"]


def _plan(name: str) -> meshplan.Plan:
    w = build_workload(SPEC, device="meta")
    return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                         memory_budget_gb=0, dtype="fp32", name=SPEC, **PLANS[name])


def test_every_plan_resumes_every_other_plans_checkpoint(pool4, tmp_path: Path) -> None:
    pairs = set(zip(ORDER, ORDER[1:]))
    assert len(pairs) == len(PLANS) * (len(PLANS) - 1)
    plans = {name: _plan(name) for name in PLANS}
    w = build_workload(SPEC, device="cpu", seed=0)
    data = batches(w, len(ORDER))
    ref_losses, ref_params = one_device(w, data)
    losses, load = [], None
    for step, name in enumerate(ORDER):
        save = str(tmp_path / f"ck{step}")
        results = pool4.run(resume_and_train, plans[name], SPEC, data[step:step + 1], load,
                            save, step)
        got, extra = results[0]
        assert all(r[0] == pytest.approx(got, rel=1e-12) for r in results)
        assert extra == ({"step": step} if load else {})
        losses += got
        load = save
    assert losses == pytest.approx(ref_losses, rel=1e-4), (losses, ref_losses)
    # The last checkpoint, whole, into the plain single-device model.
    model = build_workload(SPEC, device="cpu", seed=0).model
    state = meshplan.load_model_state(load, into=model)
    for name, ref in ref_params.items():
        got = dict(model.named_parameters())[name]
        assert torch.equal(got, state[name])
        err = (got - ref).norm() / ref.norm()
        assert err < 1e-4, (name, float(err))


def test_a_checkpoint_of_another_model_is_refused(pool4, tmp_path: Path) -> None:
    plan = _plan("data")
    w = build_workload(SPEC, device="cpu", seed=0)
    pool4.run(resume_and_train, plan, SPEC, batches(w, 1), None, str(tmp_path / "a"), 0)
    other = "gpt:hidden=64,layers=4,heads=4,seq=8,vocab=64,batch=8"
    wo = build_workload(other, device="meta")
    other_plan = meshplan.plan(wo.model, wo.loss_fn, "adamw", wo.example_batch, "local:4",
                               mesh_shape=(1, 4), method="data", memory_budget_gb=0,
                               dtype="fp32", name=other)
    # Each rank refuses it (caught on the rank: a raise would close the session's pool, and the
    # next test would pay for a new one).
    refusals = pool4.run(_refused, other_plan, other,
                         batches(build_workload(other, device="cpu"), 1), str(tmp_path / "a"),
                         str(tmp_path / "b"), 1)
    assert len(refusals) == 4
    for message in refusals:
        assert message is not None and "is of another model" in message, message
    with pytest.raises(ValueError, match="not a meshplan checkpoint"):
        meshplan.load_model_state(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="is of another model"):
        meshplan.load_model_state(str(tmp_path / "a"), into=build_workload(other).model)


def _refused(rank: int, nprocs: int, *args) -> str | None:
    """`resume_and_train` on a rank: the ValueError it raises, as text (None if it ran)."""
    try:
        resume_and_train(rank, nprocs, *args)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_checkpoint_moves_between_world_sizes(pool2, pool4, tmp_path: Path) -> None:
    # Saved by 4 processes (data parallel), resumed by 2 (Megatron on a (1, 2) mesh), then by
    # 4 again (the 2-stage pipeline): the losses of one device all along.
    w = build_workload(SPEC, device="cpu", seed=0)
    data = batches(w, 3)
    ref_losses, _ = one_device(w, data)
    runs = [(pool4, _plan("data")),
            (pool2, meshplan.plan(*_meta_args(), "local:2", mesh_shape=(1, 2),
                                  method="megatron", memory_budget_gb=0, dtype="fp32",
                                  name=SPEC)),
            (pool4, _plan("pipeline"))]
    losses, load = [], None
    for step, (pool, plan) in enumerate(runs):
        save = str(tmp_path / f"ck{step}")
        losses += pool.run(resume_and_train, plan, SPEC, data[step:step + 1], load, save,
                           step)[0][0]
        load = save
    assert losses == pytest.approx(ref_losses, rel=1e-4)


def _meta_args() -> tuple:
    w = build_workload(SPEC, device="meta")
    return w.model, w.loss_fn, "adamw", w.example_batch
