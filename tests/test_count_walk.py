"""The walk over micro-batch counts (`search._CountSearch`): under "auto", a count whose fastest
pipeline is one stage ends the walk down, the fewer micro-batches left to one stage's own plan
(`api._weighs_intra_only`) and to the probe where a micro-batch gives each device a sample —
and auto's plan is still as fast as the best of planning each
count alone. Methods whose strategies depend on the batch dividing the devices (inter-only's
data parallelism) walk the counts down as before."""

from __future__ import annotations

import pytest

import meshplan.api as api
import meshplan.planner.inter.search as search
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload

SGD = OptimizerSpec("sgd", lr=0.1)


@pytest.mark.parametrize("spec,cluster,method,searched_counts", [
    # 4 samples on 8 devices: no count gives every device one, so there is no probe.
    ("mlp:layers=2,hidden=64,batch=4", "p3.16xlarge:1x8", "auto", [4]),
    # Micro-batches of fewer samples than devices cannot be data parallel: inter-only's
    # one stage is then replicated, with no gradient all-reduce across hosts, and fastest
    # at 8 of 16 counts; its strategies do not grow with the batch, so it walks down.
    ("mlp:layers=4,hidden=256,batch=16", "p3.16xlarge:2x2", "inter-only", [16, 8, 4]),
])
def test_one_stage_ends_the_walk_down(spec: str, cluster: str, method: str,
                                      searched_counts: list[int],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = build_workload(spec, device="meta")
    searched: list[int] = []
    one = search._search_one

    def spy(graph_for, b, req):   # noqa: ANN001 - the search's own signature
        searched.append(b)
        return one(graph_for, b, req)

    monkeypatch.setattr(search, "_search_one", spy)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method)
    assert plan.num_stages == 1 and searched == searched_counts
    monkeypatch.setattr(search, "_search_one", one)
    counts = api._microbatch_counts("auto", int(spec.rsplit("=", 1)[1]))
    each = {b: api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method,
                        microbatches=b).predicted["step_time_s"] for b in counts}
    assert plan.predicted["step_time_s"] <= min(each.values()) * (1 + 1e-9), (plan.microbatches,
                                                                              each)
