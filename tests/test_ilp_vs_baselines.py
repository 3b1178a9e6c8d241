"""The ILP's plan is never worse than a baseline's, by the same cost model and budget."""

from __future__ import annotations

import functools

import pytest

import meshplan
from meshplan.zoo.spec import Workload, build_workload

PRESETS = {
    "gpt": "gpt:hidden=256,layers=2,heads=8,seq=128,vocab=1024,batch=16",
    "moe": "moe:hidden=128,layers=2,heads=4,experts=8,seq=64,vocab=512,batch=8",
    "wresnet": "wresnet:layers=26,channels=16,width=2,image=32,classes=100,batch=32",
}
BASELINES = ("data", "zero2", "zero3", "megatron", "heuristic")


@functools.cache
def _workload(name: str) -> Workload:
    """One model per preset for its 4 cases: meshplan's capture memo then traces it once."""
    return build_workload(PRESETS[name])


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
@pytest.mark.parametrize("units", ["alpha-beta", "seconds"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_ilp_is_never_worse_than_a_baseline(name: str, units: str, mesh) -> None:
    w = _workload(name)
    kw = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if units == "alpha-beta" else {}
    budget = 0 if units == "alpha-beta" else 16  # GiB per device (V100 memory)

    def plan(method: str) -> meshplan.Plan:
        return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1x4",
                             mesh_shape=mesh, method=method, memory_budget_gb=budget, **kw)

    best = plan("auto").objective
    methods = BASELINES + (("expert",) if name == "moe" else ())
    for method in methods:
        other = plan(method).objective
        assert best <= other * (1 + 1e-9), f"{method}: {other} < ILP {best}"
