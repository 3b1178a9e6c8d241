"""Property test (DESIGN §5): random valid strategy assignments train exactly like one device.

Each case solves the model's own ILP under random costs (`random_plans.py`), lowers the plan,
trains two steps on emulated ranks and checks losses, parameters and recorded == planned
collectives against the single-device oracle; in α-β units, the ILP's charge for the plan equals
the α-β cost of the collectives it lists. About 150 plans across the zoo's families,
tied language models and mixture-of-experts.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload
from oracle import (alpha_beta_sum, assert_matches, batches, reference, shared_capture,
                    train_rank)
from random_plans import random_plan

SGD = OptimizerSpec("sgd", lr=0.05)
MODELS = {
    "mlp": "mlp:layers=3,hidden=16,batch=8,bias=1",
    "tied-gpt": "gpt:hidden=16,layers=1,heads=2,seq=8,vocab=32,batch=4",
    "moe": "moe:hidden=16,layers=1,heads=2,experts=4,seq=8,vocab=32,batch=4",
    "vgg": "vgg19:channels=4,fc=16,image=32,classes=10,batch=4",
}
SHAPES = [(1, 2), (2, 1), (1, 4), (2, 2)]
# (model, seeds per mesh shape): 4 shapes x (16 + 8 + 8 + 2) = 136 plans, and 12 of GPT-2; every
# model on every shape draws plans under both cost settings (odd seeds abstract, even real).
SEEDS = {"mlp": 16, "tied-gpt": 8, "moe": 8, "vgg": 2}


@functools.cache
def _model(name: str) -> tuple[Any, Any, list, tuple, Any]:
    """Per model, for every mesh shape: the meta workload the plans are made of (one object, so
    meshplan's capture memo traces it once), the seeded CPU workload, 2 batches, the oracle's
    result and the capture (training reads the workload, never changes it)."""
    spec = MODELS[name]
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 2)
    return build_workload(spec, device="meta"), w, data, reference(w, SGD, data), \
        shared_capture(w)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("name", list(MODELS))
def test_random_plans_equal_single_device(name: str, shape: tuple[int, int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    meta, w, data, ref, captured = _model(name)
    seen = set()
    for seed in range(SEEDS[name]):
        abstract = seed % 2 == 1
        plan = random_plan(meta.model, meta.loss_fn, SGD, meta.example_batch, shape,
                           1000 * shape[0] + 100 * shape[1] + seed, monkeypatch,
                           abstract=abstract)
        seen.add(tuple(o.strategy for o in plan.ops) + tuple(p.update for p in plan.params))
        if abstract:  # the ILP charges exactly what runs
            assert plan.objective == pytest.approx(alpha_beta_sum(plan), rel=1e-6, abs=1e-3)
        for r in run_emulated(train_rank, shape, plan, w, data, captured):
            assert_matches(r, ref, plan, SGD)
    assert len(seen) >= max(1, SEEDS[name] // 2), "random plans should differ"


@functools.cache
def _gpt2() -> tuple[Any, list, tuple, Any]:
    """GPT-2's workload, 2 batches, the oracle's result and capture, shared by the mesh shapes."""
    import test_hf_models as hf
    from meshplan.zoo.spec import Workload
    w = Workload(hf.build("gpt2"), None, hf.batch("gpt2", 0), "gpt2")
    data = hf.data("gpt2")[:2]
    return w, data, reference(w, SGD, data), shared_capture(w)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_random_plans_of_a_hugging_face_model(shape: tuple[int, int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # GPT-2 as its authors wrote it (tied head, padding, -100 labels, its own loss).
    w, data, ref, captured = _gpt2()
    for seed in range(3):
        plan = random_plan(w.model, None, SGD, w.example_batch, shape,
                           7000 + 100 * shape[0] + 10 * shape[1] + seed, monkeypatch,
                           abstract=seed % 2 == 1)
        for r in run_emulated(train_rank, shape, plan, w, data, captured):
            assert_matches(r, ref, plan, SGD)
