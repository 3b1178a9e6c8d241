"""Issue 3's model families equal single-device training under the ILP and the baselines.

Wide-ResNet is checked in float64: with batch norm over few elements and max pooling, its
float32 training is itself ill-conditioned (the float32 single-device run differs from the
float64 one by ~1e-4 after three steps, and a 1e-7 nudge of the weights moves the third loss by
~1e-3), so no float32 program with another summation order can match it at 1e-5.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import meshplan.api as api
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import Workload, build_workload
from oracle import assert_matches, batches, reference, shared_capture, train_rank

SGD = OptimizerSpec("sgd", lr=0.01)
MODELS = {
    "vgg": "vgg19:channels=8,fc=64,image=32,classes=10,batch=8",
    "moe": "moe:hidden=32,layers=2,heads=4,experts=4,seq=16,vocab=64,batch=4",
    "tied-lm": "gpt:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=4",
    "wresnet": "wresnet:layers=26,channels=8,width=2,image=32,classes=10,batch=8",
}
# Attention with the scores materialized (Megatron-LM's and Alpa's, `zoo/gpt.py`).
EXPLICIT = {"explicit-attention": "gpt:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=4,flash=0"}
FLOAT64 = {"wresnet"}
METHODS = [("auto", True), ("data", False), ("zero2", False), ("zero3", False),
           ("megatron", False),
           ("heuristic", False)]


@functools.cache
def _workload(name: str, device: str) -> Workload:
    """One model object per name and device for the module: a case plans the meta one and trains
    the CPU one, so meshplan's per-model capture memo (`capture/memo.py`) traces each once."""
    w = build_workload((MODELS | EXPLICIT)[name], device=device, seed=0)
    if name not in FLOAT64:
        return w
    model = copy.deepcopy(w.model).double()
    (x,), t = w.example_batch
    return Workload(model, w.loss_fn, ((x.double(),), t), w.name)


def _double(data: list) -> list:
    return [((x.double(),), t) for (x,), t in data]


@functools.cache
def _oracle(name: str) -> tuple[list, tuple, object]:
    """The batches, the single-device result and the capture of ``name``: the same for every
    method and mesh (training reads the workload, never changes it)."""
    w = _workload(name, "cpu")
    data = batches(build_workload((MODELS | EXPLICIT)[name], device="cpu", seed=0), 3)
    if name in FLOAT64:
        data = _double(data)
    return data, reference(w, SGD, data), shared_capture(w)


@pytest.mark.parametrize("method,abstract", METHODS, ids=[m for m, _ in METHODS])
@pytest.mark.parametrize("shape", [(1, 2), (1, 4)], ids=["2", "4"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_family_matches_single_device(name: str, shape, method: str, abstract: bool
                                            ) -> None:
    meta = _workload(name, "meta")
    units = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if abstract else {}
    devices = shape[0] * shape[1]
    plan = api.plan(meta.model, meta.loss_fn, SGD, meta.example_batch, f"local:{devices}",
                    mesh_shape=shape, method=method, memory_budget_gb=0, **units)
    w = _workload(name, "cpu")
    data, ref, captured = _oracle(name)
    tol_scale = 1e-4 if name in FLOAT64 else 1.0   # float64: check 1e-9 instead of 1e-5
    for r in run_emulated(train_rank, shape, plan, w, data, captured):
        assert_matches(r, ref, plan, SGD, tol=1e-5 * tol_scale)


@pytest.mark.parametrize("method,abstract", [("auto", True), ("megatron", False)])
@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 2)], ids=["2", "4", "2x2"])
def test_explicit_attention_matches_single_device(shape, method: str, abstract: bool) -> None:
    test_model_family_matches_single_device("explicit-attention", shape, method, abstract)


@pytest.mark.parametrize("shape", [(1, 2), (1, 4)], ids=["2", "4"])
def test_expert_parallel_baseline_matches_single_device(shape) -> None:
    test_model_family_matches_single_device("moe", shape, "expert", False)
