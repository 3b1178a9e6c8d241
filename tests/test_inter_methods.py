"""Planning methods of the inter-operator pass besides the search: Alpa's equal-operator
ablation, on a tiny GPT and the cost model."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.zoo.spec import build_workload

TINY = "gpt:hidden=64,layers=4,heads=4,seq=32,vocab=128,batch=16"


@pytest.fixture(scope="module")
def tiny():
    return build_workload(TINY, device="meta")


def _plan(w, cluster: str, **kw) -> api.Plan:
    return api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, **kw)


# ---------------------------------------------------------------- equal operator


def test_equal_operator_layers_hold_equal_op_counts(tiny) -> None:
    graph = capture(tiny.model, tiny.loss_fn, tiny.example_batch)[1]
    for num_layers in (3, 4, 7):
        layering = cluster_layers(graph, num_layers, balance="ops")
        counts = [sum(graph.by_name[x].role == "op" for x in names) for names in layering.layers]
        assert max(counts) - min(counts) <= 1
        assert sum(counts) == sum(n.role == "op" for n in graph.nodes)
    with pytest.raises(ValueError, match="balance='size'"):
        cluster_layers(graph, 3, balance="size")


def test_equal_operator_runs_the_stage_dp(tiny) -> None:
    p = _plan(tiny, "p3.16xlarge:1x2", method="equal-operator", microbatches=2, num_layers=4)
    assert p.method == "equal-operator" and p.num_layers == 4
    assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == 4
    assert sum(len(s.devices) for s in p.stages) == 2
