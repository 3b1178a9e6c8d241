"""The compute bound (`cost/bounds.py`): no plan of any method beats it, and a compute-bound
program on one device comes close to it."""

from __future__ import annotations

import functools

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.cost.bounds import compute_bound_s
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.precision import with_compute_dtype
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=256,layers=4,heads=4,seq=128,vocab=512,batch=32"
MLP = "mlp:hidden=4096,layers=3,batch=4096"


@functools.cache
def _meta(spec: str) -> object:
    """One meta model per spec for the module: meshplan's capture memo then traces it once."""
    return build_workload(spec, device="meta")


def _bound(spec: str, cluster: str, dtype: str) -> tuple[float, object]:
    w = _meta(spec)
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    return compute_bound_s(with_compute_dtype(graph, dtype), parse_cluster_spec(cluster)), w


CASES = [(cluster, method, dtype) for cluster in ("p3.16xlarge:1x1", "p3.16xlarge:1x4",
                                                  "p3.16xlarge:2")
         for method in ("data", "megatron", "zero3") for dtype in ("fp32", "fp16")]
# The two-level search on a few devices (on 16 it takes 15 s here).
CASES += [("p3.16xlarge:1x4", "auto", "fp16"), ("p3.16xlarge:1x1", "auto", "fp32")]


@pytest.mark.parametrize("cluster,method,dtype", CASES)
def test_no_plan_beats_the_bound(cluster: str, method: str, dtype: str) -> None:
    bound, w = _bound(GPT, cluster, dtype)
    p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, method=method,
                 dtype=dtype, memory_budget_gb=0)
    assert 0 < bound <= p.predicted["step_time_s"]


def test_one_device_compute_bound_program_is_near_the_bound() -> None:
    bound, w = _bound(MLP, "p3.16xlarge:1x1", "fp32")
    p = api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "p3.16xlarge:1x1", dtype="fp32",
                 memory_budget_gb=0)
    # Big matmuls: all but the elementwise ops and the update is arithmetic at peak.
    assert bound <= p.predicted["step_time_s"] <= 1.1 * bound
    # Twice the devices, half the bound.
    assert compute_bound_s(with_compute_dtype(capture(w.model, w.loss_fn, w.example_batch)[1],
                                              "fp32"),
                           parse_cluster_spec("p3.16xlarge:1x2")) == pytest.approx(bound / 2)
