"""Hugging Face models called the usual way (``model(input_ids=…, attention_mask=…, labels=…)``,
their own loss with -100 padding labels, default settings: KV cache on, sdpa attention) are
traced, planned with every method and train exactly like one device on 4 emulated ranks."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from hf_models import MODELS, hf_batches, hf_workload
from oracle import assert_matches, reference, train_rank

SGD = OptimizerSpec("sgd", lr=0.1)
ADAMW = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.01)
METHODS = ["auto", "data", "megatron", "zero3"]
SHAPES = [(1, 4), (2, 2)]


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest) -> dict:
    w = hf_workload(request.param)
    data = hf_batches(request.param, 3)
    return {"name": request.param, "w": w, "data": data,
            "captured": capture(w.model, w.loss_fn, w.example_batch),
            "ref": {opt.kind: reference(w, opt, data) for opt in (SGD, ADAMW)}}


def _train(case: dict, method: str, shape: tuple[int, int], opt: OptimizerSpec) -> None:
    w = case["w"]
    plan = api.plan(w.model, None, opt, w.example_batch, "local:4", mesh_shape=shape,
                    method=method, memory_budget_gb=0, name=case["name"])
    assert not plan.options["unsupported_ops"] or method, plan.options["unsupported_ops"]
    for r in run_emulated(train_rank, shape, plan, w, case["data"], case["captured"]):
        assert_matches(r, case["ref"][opt.kind], plan, opt)


@pytest.mark.parametrize("shape", SHAPES, ids=["1x4", "2x2"])
@pytest.mark.parametrize("method", METHODS)
def test_hf_model_equals_single_device_sgd(case: dict, method: str, shape) -> None:
    _train(case, method, shape, SGD)


@pytest.mark.parametrize("method", ["auto", "megatron"])
def test_hf_model_equals_single_device_adamw(case: dict, method: str) -> None:
    _train(case, method, (2, 2), ADAMW)


def test_hf_models_capture_without_unsigned_ops() -> None:
    # Rotary embeddings (cos, sin), position ids, padding masks: all signed, none replicated.
    for name in MODELS:
        w = hf_workload(name)
        _, graph = capture(w.model, w.loss_fn, w.example_batch)
        assert not graph.unsupported_ops, (name, graph.unsupported_ops)
