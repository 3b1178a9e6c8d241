"""The walk over micro-batch counts (`search._CountSearch`): once a count's fastest pipeline is
one stage, the walk jumps to the fewest micro-batches that pass the memory floor and climbs
back, instead of trying every count on the way down — and still finds the count that trying
each one alone finds. Methods whose strategies depend on the batch dividing the devices
(inter-only's data parallelism) walk every count down as before."""

from __future__ import annotations

import pytest

import meshplan.api as api
import meshplan.planner.inter.search as search
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload

SGD = OptimizerSpec("sgd", lr=0.1)


@pytest.mark.parametrize("spec,cluster,method,climbs", [
    ("mlp:layers=4,hidden=256,batch=64", "p3.16xlarge:1x4", "auto", True),
    ("mlp:layers=4,hidden=256,batch=32", "p3.16xlarge:2x2", "auto", True),
    # Micro-batches of fewer samples than devices cannot be data parallel: inter-only's
    # one stage is then replicated, with no gradient all-reduce across hosts, and fastest
    # at 16 of 32 counts; its strategies do not grow with the batch, so it walks down.
    ("mlp:layers=4,hidden=256,batch=32", "p3.16xlarge:2x2", "inter-only", False),
])
def test_one_stage_climbs_from_the_fewest_micro_batches(spec: str, cluster: str, method: str,
                                                        climbs: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    w = build_workload(spec, device="meta")
    searched: list[int] = []
    one = search._search_one

    def spy(graph_for, b, req):   # noqa: ANN001 - the search's own signature
        searched.append(b)
        return one(graph_for, b, req)

    monkeypatch.setattr(search, "_search_one", spy)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method)
    counts = api._microbatch_counts("auto", int(spec.rsplit("=", 1)[1]))
    assert plan.num_stages == 1 and searched[0] == counts[-1]
    # Climbing, the walk left the top for the bottom and skipped the counts between.
    assert (searched[1] == counts[0] and len(searched) < len(counts)) == climbs, searched
    monkeypatch.setattr(search, "_search_one", one)
    each = {b: api.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method=method,
                        microbatches=b).predicted["step_time_s"] for b in counts}
    assert plan.predicted["step_time_s"] <= min(each.values()) * (1 + 1e-9), (plan.microbatches,
                                                                              each)
