"""Stage prices shared between the searches of one request (`planner/inter/price_sharing.py`):
the typed-stage search on a mixed cluster reads the uniform search's prices where they were
made on the same cost context, and plans exactly what it plans alone."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

import meshplan
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import Cluster, mixed_cluster
from meshplan.cost.devices import DEVICE_TYPES, Link, link_preset
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter import price_sharing
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.device_kinds import host_types, kind_types
from meshplan.planner.inter.stage_costs import StageLabel, StageProfiler
from meshplan.planner.intra.choices import IntraOptions
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import build_workload

V100, P100 = DEVICE_TYPES["V100-SXM2-16GB"], DEVICE_TYPES["P100-SXM2-16GB"]
GPT = "gpt:hidden=128,layers=4,heads=4,seq=16,vocab=128,batch=16"
ETHERNET = Link(1.3e9, 50e-6)


def _hosts(per_host: int, slow_hosts: int, inter_host: Link = ETHERNET) -> Cluster:
    return mixed_cluster("v100+p100", [[V100] * per_host] + [[P100] * per_host] * slow_hosts,
                         link_preset("pcie3"), inter_host)


def _as_slowest(cl: Cluster) -> Cluster:
    return cl.submesh(f"{cl.name} (as its slowest device)", cl.num_hosts, cl.devices_per_host)


@pytest.fixture(scope="module")
def program():
    w = build_workload(GPT, device="meta")
    graph = with_compute_dtype(capture(w.model, w.loss_fn, w.example_batch)[1], "fp32")
    return graph, cluster_layers(graph, 4)


def _profiler(program, cl: Cluster, kinds=(), microbatches: int = 2) -> StageProfiler:
    graph, layering = program
    return StageProfiler(graph, layering, cl, IntraOptions(optimizer="adamw"),
                         OptimizerState(), microbatches, memory_limit=16 * 2**30, kinds=kinds,
                         tensor_within_host=bool(kinds), lazy=True)


SUBMESHES = ((1, 1), (1, 2), (2, 2), (4, 2))


def test_prices_are_taken_only_where_made_on_the_same_context(program) -> None:
    mixed = _hosts(2, 3)
    base = _profiler(program, _as_slowest(mixed))
    base.prefetch(SUBMESHES, workers=1)
    whole = base.whole_cost(0, 2, (2, 2), StageLabel((2, 2), "free", False), 2)
    typed = _profiler(program, mixed, kind_types(host_types(mixed), "fp32"))
    taken = typed.adopt(base)
    adopted = set(typed._costed)
    assert taken == sum(len(p._costed) for p in typed._pricers()) + 1 > len(adopted) > 0
    # The stage solved whole, too (the same memory limit).
    assert typed.whole_cost(0, 2, (2, 2, 1), StageLabel((2, 2), "free", False), 2) == whole
    assert typed.solves == 0
    assert {k[1] for k in adopted} <= set(SUBMESHES)   # its layers' parts priced as well
    # What it took is what it would have priced: the same options, solved only where the
    # base did not price (a host-granular search lists the ring over hosts as (n, 1)).
    fresh = _profiler(program, mixed, kind_types(host_types(mixed), "fp32"))
    for sub in ((1, 2), (2, 2), (4, 2)):
        for start, end in ((0, 1), (1, 2), (1, 3), (0, 4)):
            assert typed.estimates(start, end, sub) == fresh.estimates(start, end, sub)
    solved = {k[1:3] for k in set(typed._costed) - adopted}
    assert solved == {((2, 2), (4, 1)), ((4, 2), (8, 1))}
    assert 0 < typed.solves < fresh.solves
    # A typed submesh of the fast kind is priced on its own device: nothing taken for it.
    solves = typed.solves
    v100 = typed.estimates(0, 1, (1, 2, 0))
    assert typed.solves > solves and v100 != base.estimates(0, 1, (1, 2))

    # Other links between hosts: the one-host prices are taken, the multi-host ones are not.
    slower = _profiler(program, _as_slowest(_hosts(2, 3, Link(0.5e9, 50e-6))))
    slower.adopt(base)
    assert {k[1] for k in slower._costed} == {(1, 1), (1, 2)}
    # Another memory limit: the prices, not the stages solved whole.
    looser = _profiler(program, _as_slowest(mixed))
    looser.memory_limit = 32 * 2**30
    assert looser.adopt(base) == taken - 1 and not looser._whole_costs
    # Another link inside hosts: not even the prices of one device (which layers are priced
    # by parts is decided on a mesh of two, on that link).
    nvlink = mixed_cluster("v100+p100", [[V100] * 2] + [[P100] * 2] * 3,
                           link_preset("nvlink-v100"), ETHERNET)
    assert _profiler(program, _as_slowest(nvlink)).adopt(base) == 0
    # Another micro-batch count, or other options: nothing.
    assert _profiler(program, _as_slowest(mixed), microbatches=4).adopt(base) == 0
    other = _profiler(program, _as_slowest(mixed))
    other.options = replace(other.options, prefer_reduce_scatter=True)
    assert other.adopt(base) == 0


def test_profilers_share_only_inside_a_scope(program) -> None:
    cl = _as_slowest(_hosts(2, 3))
    first = _profiler(program, cl)
    first.prefetch(SUBMESHES, workers=1)
    second = _profiler(program, cl)
    second.prefetch(SUBMESHES, workers=1)
    assert second.solves == first.solves > 0
    with price_sharing.shared_prices():
        first = _profiler(program, cl)
        first.prefetch(SUBMESHES, workers=1)
        with price_sharing.shared_prices():   # nested: the outer scope's
            second = _profiler(program, cl)
            second.prefetch(SUBMESHES, workers=1)
        assert second.solves == 0 and second._costed == first._costed
    assert price_sharing.priced_before() == ()


SGD = OptimizerSpec("sgd", lr=0.05)


def _auto(cluster: Cluster) -> meshplan.Plan:
    w = build_workload(GPT, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, method="auto",
                             dtype="fp32", name=GPT, num_layers=4, microbatches=4)


def test_the_typed_search_plans_the_same_with_the_uniform_searchs_prices(monkeypatch) -> None:
    taken: list[tuple[bool, int]] = []
    adopt = StageProfiler.adopt

    def counted(self: StageProfiler, base: StageProfiler) -> int:
        n = adopt(self, base)
        taken.append((bool(self.kinds) and not base.kinds, n))
        return n

    monkeypatch.setattr(StageProfiler, "adopt", counted)
    cluster = _hosts(2, 3)
    shared = _auto(cluster)
    assert any(typed_from_uniform and n > 0 for typed_from_uniform, n in taken), taken
    monkeypatch.setattr(StageProfiler, "adopt", lambda self, base: 0)
    alone = _auto(cluster)
    assert shared.options["mixed_auto"] == alone.options["mixed_auto"]
    assert (shared.stages, shared.predicted, shared.microbatches) == \
        (alone.stages, alone.predicted, alone.microbatches)
