"""Pure unit tests of the intra-op planner: layouts, strategies, resharding recipes, budgets."""

from __future__ import annotations

import pytest

import meshplan
from meshplan.errors import InfeasiblePlanError
from meshplan.ir.signatures import Signature
from meshplan.planner.intra.layout import Layout, canonical_sizes, split_sizes
from meshplan.planner.intra.reshard import reshard
from meshplan.planner.intra.strategies import enumerate_strategies, follow
from meshplan.zoo.spec import build_workload

MESH = (2, 2)


def L(spec: str, ndim: int = 2) -> Layout:
    return Layout.parse(spec, ndim)


def ops(recipe) -> list[tuple[str, tuple[int, ...], str]]:
    return [(s.op, s.axes, s.backward) for s in recipe.steps]


def test_layout_specs_round_trip() -> None:
    for spec in ("R,R", "S0,R", "R,S1", "S01,R", "S0,S1", "R,R,P1"):
        assert L(spec).spec() == spec
    with pytest.raises(ValueError, match="3-d tensor"):
        Layout.parse("S0,R", 3)


def test_split_sizes_follow_tensor_split_and_weights() -> None:
    assert split_sizes(10, [1, 1, 1, 1]) == (3, 3, 2, 2)
    assert split_sizes(8, [3, 1]) == (6, 2)
    assert canonical_sizes(10, (0, 1), [[1, 1], [1, 1]]) == (3, 2, 3, 2)


def test_partial_sum_to_replicated_is_an_all_reduce() -> None:
    r = reshard(L("R,R,P1"), L("R,R"), 4096, MESH, (), True)
    assert ops(r) == [("all_reduce", (1,), "identity")]
    r = reshard(L("R,R,P1"), L("R,R"), 4096, MESH, (1,), True)
    assert ops(r) == [("all_reduce", (1,), "all_reduce")]


def test_partial_sum_to_split_is_a_reduce_scatter() -> None:
    r = reshard(L("R,R,P1"), L("S1,R"), 4096, MESH)
    assert ops(r) == [("reduce_scatter", (1,), "all_gather")]
    assert r.steps[0].nbytes == 4096


def test_gather_whose_consumer_splits_work_reduce_scatters_in_backward() -> None:
    r = reshard(L("S1,R"), L("R,R"), 4096, MESH, (1,), True)
    assert ops(r) == [("all_gather", (1,), "reduce_scatter")]
    assert r.steps[0].nbytes == 4096  # the gathered output
    r = reshard(L("S1,R"), L("R,R"), 4096, MESH, (), True)
    assert ops(r) == [("all_gather", (1,), "slice")]


def test_moving_a_split_between_dims_is_an_all_to_all() -> None:
    r = reshard(L("S1,R"), L("R,S1"), 4096, MESH)
    assert ops(r) == [("all_to_all", (1,), "all_to_all")]
    assert r.steps[0].nbytes == 4096


def test_replicated_feeding_split_work_marks_its_gradient() -> None:
    r = reshard(L("R,R"), L("R,R"), 4096, MESH, (0, 1), True)
    assert ops(r) == [("grad_all_reduce", (0, 1), "all_reduce")]
    # ... but a parameter's partial gradient is left to the update-phase bucket.
    r = reshard(L("R,R"), L("R,R"), 4096, MESH, (0, 1), True, param_root=True)
    assert r.steps == () and r.sync_axes == (0, 1)
    # A tensor that needs no gradient needs no mark.
    assert reshard(L("R,R"), L("R,R"), 4096, MESH, (0, 1), False).steps == ()


def test_s01_to_s0_gathers_only_the_inner_axis() -> None:
    r = reshard(L("S01,R"), L("S0,R"), 4096, MESH)
    assert ops(r) == [("all_gather", (1,), "slice")]
    assert r.steps[0].nbytes == 2048


MM = Signature((("i", "k"), ("k", "j")), ("i", "j"), "contraction",
               atom_sizes=(("i", 8), ("k", 8), ("j", 8)))


def test_matmul_strategies_are_alpas_table() -> None:
    one_d = enumerate_strategies(MM, (1,), (1, 4), full_split=True)
    assert {s.describe() for s in one_d} == {"i:S1", "j:S1", "k:S1"}
    row = next(s for s in one_d if s.describe() == "k:S1")
    assert row.output.spec() == "R,R,P1"
    assert [l.spec() for l in row.inputs] == ["R,S1", "S1,R"]
    col = next(s for s in one_d if s.describe() == "j:S1")
    assert col.grad_partial == ((1,), ())  # the replicated activation's gradient is partial
    two_d = enumerate_strategies(MM, (0, 1), MESH, full_split=True)
    assert len(two_d) == 9  # 3 atoms per axis, S01 included
    assert len(enumerate_strategies(MM, (0, 1), MESH)) == 16


def test_follower_gathers_what_it_cannot_split() -> None:
    softmax = Signature((("a", "b"),), ("a", "b"), "elementwise", frozenset({"b"}),
                        atom_sizes=(("a", 8), ("b", 8)))
    s = follow(softmax, 0, L("S0,S1"), MESH)
    assert s.inputs[0].spec() == "S0,R" and s.output.spec() == "S0,R"
    s = follow(softmax, 0, L("R,R,P1"), MESH)
    assert s.inputs[0].spec() == "R,R"  # partial sums are reduced before a follower


def test_memory_budget_trades_communication_for_zero() -> None:
    w = build_workload("mlp:layers=4,hidden=256,batch=8")
    roomy = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                          method="data", memory_budget_gb=1)
    need = roomy.predicted["peak_memory_bytes"]
    tight = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                          method="data", memory_budget_gb=0.8 * need / 2**30)
    assert tight.predicted["peak_memory_bytes"] <= 0.8 * need
    # With room, ZeRO-2 at most, where its sharded update pays for its collectives (the
    # weight matrices here); under the budget ZeRO-3, at a cost in time.
    assert "zero3" in {p.update for p in tight.params} - {p.update for p in roomy.params}
    assert tight.predicted["step_time_s"] > roomy.predicted["step_time_s"]
    with pytest.raises(InfeasiblePlanError) as info:
        meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4",
                      method="data", memory_budget_gb=0.05 * need / 2**30)
    assert info.value.min_memory_bytes > 0.05 * need
    assert "smallest plan needs" in str(info.value)


def test_planning_and_simulating_pause_the_cycle_collector(monkeypatch) -> None:
    """The cycle collector is off while a plan is made or simulated (its full collections
    walked every object they hold: a quarter of GPT-3 175B's search) and as it was after,
    also when they fail."""
    import gc

    from meshplan import api
    from types import SimpleNamespace

    from meshplan.sim import simulate
    seen = []

    def fails(*a, **k):
        seen.append(gc.isenabled())
        raise ValueError("a bad request")

    monkeypatch.setattr(api, "_plan", fails)
    monkeypatch.setattr(simulate, "cluster_from_dict", fails)
    assert gc.isenabled()
    with pytest.raises(ValueError, match="a bad request"):
        api.plan(None, None, "adamw", None, "p3.16xlarge:1")
    with pytest.raises(ValueError, match="a bad request"):
        simulate.simulate(SimpleNamespace(cluster={}))
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(ValueError):
            api.plan(None, None, "adamw", None, "p3.16xlarge:1")
        assert not gc.isenabled()   # left as the caller had it
    finally:
        gc.enable()
