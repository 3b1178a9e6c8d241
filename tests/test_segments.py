"""Per-segment shard ratios (HAP §5.2, issue 10): the program cut into model segments, each
split by its own ratios, values re-cut by an all-to-all where another segment reads them —
trained equal to one device (gloo and emulated, fixed and random ratios, random cuts), the
re-cuts the runtime makes listed by the plan, and the planner taking segments only when they
pay (a matmul-bound half and a memory-bound half on devices fast at one only)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn

import meshplan
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import Cluster, mixed_cluster
from meshplan.cost.devices import DeviceType, Link
from meshplan.lower.program import lower
from meshplan.plan.plan import CollectiveEntry, plan_from_json
from meshplan.planner.hetero.load_balance import Device, Phase, balance, step_time
from meshplan.planner.hetero.segments import (cut_segments, ratio_weights, resplit_entries,
                                              resplits)
from meshplan.runtime.comm import CollectiveRecord
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import Workload, build_workload
from hetero_cases import MODELS, four_speeds, planned, train_gloo, without_bytes
from oracle import (assert_matches, cpu_capture, meta_workload, reference, seeded_run,
                    train_rank)
from random_plans import random_plan

SGD = OptimizerSpec("sgd", lr=0.05)
# Three segments pulling opposite ways, the last one even.
SETS = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]


def segment_plan(spec: str, sets=SETS, **kw) -> meshplan.Plan:
    w = meta_workload(spec)   # one meta model per spec: its capture is made once
    return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, four_speeds(),
                         method="hetero", memory_budget_gb=0, name=spec, segment_ratios=sets,
                         **kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_fixed_segment_ratios_train_like_one_device_on_gloo(pool4, name: str) -> None:
    spec = MODELS[name]
    plan = segment_plan(spec)
    assert len(plan.segment_weights) == 3 and set(plan.segment_of.values()) == {0, 1, 2}
    assert [list(w[1]) for w in plan.segment_weights] == [pytest.approx(s) for s in SETS]
    _, data, ref = seeded_run(spec, SGD)   # the seeded workload's 3 batches and oracle result
    for result, _ in pool4.run(train_gloo, plan, spec, data):
        assert_matches(result, ref, plan, SGD)   # the records equal the plan's list too


def test_the_plans_above_do_re_cut() -> None:
    # The BERT-like program carries its batch-split residual stream across both segment
    # cuts, so the gloo run above exercises the re-cut (and its backward); the plan lists
    # each. (The MLP's and MoE's programs gather or move what crosses, cut anew.)
    plan = segment_plan(MODELS["bert"])
    assert plan.options["segment_recuts"] == 2
    assert sum(c.count for c in plan.collectives if c.kind == "resplit") == 4
    # A plan with segments is a plan file like any other.
    again = plan_from_json(plan.to_json())
    assert again.segment_of == plan.segment_of
    assert again.segment_weights == plan.segment_weights
    assert again.collectives == plan.collectives


RANDOM_CASES = [("mlp", 4), ("bert", 3), ("moe", 3)]


@pytest.mark.parametrize("name,seeds", RANDOM_CASES, ids=[n for n, _ in RANDOM_CASES])
def test_random_programs_random_cuts_random_ratios(name: str, seeds: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Random valid programs cut at random places into 2-4 segments with random ratios: equal
    to one device, and the collectives every rank issues are the plan's with the re-cuts
    `resplits` predicts."""
    spec = MODELS[name]
    meta = meta_workload(spec)
    w, data, ref = seeded_run(spec, SGD, 2)
    traced, graph = captured = cpu_capture(spec)
    rng = random.Random(f"segments-{name}")
    ops = [n.name for n in graph.nodes if not n.is_source]
    recut = 0
    for seed in range(seeds):
        plan = random_plan(meta.model, meta.loss_fn, SGD, meta.example_batch, (1, 4),
                           700 + seed, monkeypatch, abstract=seed % 2 == 1,
                           sfb=("force", None)[seed % 2])
        count = rng.randint(2, 4)
        cuts = sorted(rng.sample(range(1, len(ops)), count - 1))
        segment_of = {op: sum(i >= c for c in cuts) for i, op in enumerate(ops)}
        for n in graph.nodes:   # a source in its first reader's segment, as the planner does
            if n.is_source:
                readers = [segment_of[u] for u in graph.users[n.name] if u in segment_of]
                segment_of[n.name] = readers[0] if readers else 0
        weights = [ratio_weights([rng.choice((1.0, 2.0, 3.0, 5.0)) for _ in range(4)])
                   for _ in range(count)]
        found = resplits(graph, plan, segment_of, weights)
        recut += len(found)
        extra = tuple(c for _, c in resplit_entries(found, plan.microbatches, plan.recompute))
        plan = dataclasses.replace(
            plan, segment_of=segment_of, segment_weights=tuple(weights),
            axis_weights=weights[0], collectives=plan.collectives + extra,
            options={**plan.options, "gather_impl": ("padded", "broadcast")[seed % 2]})
        for losses, params, per_step in run_emulated(train_rank, (1, 4), plan, w, data,
                                                     captured):
            assert_matches((losses, params, [planned(plan)] * len(per_step)), ref, plan, SGD)
            for got in per_step:
                assert without_bytes(got) == without_bytes(planned(plan)), seed
    assert recut > 0, "no random cut crossed a split value: the test exercises nothing"


def test_cut_segments_balances_flops_and_cuts_where_little_crosses() -> None:
    w = build_workload("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=4",
                       device="meta")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    ops = [n for n in graph.nodes if not n.is_source]
    total = sum(n.flops for n in ops)
    for count in (1, 2, 4):
        seg = cut_segments(graph, count)
        order = [seg[n.name] for n in ops]
        assert order == sorted(order) and set(order) == set(range(count))   # contiguous
        for k in range(count):
            share = sum(n.flops for n in ops if seg[n.name] == k) / total
            assert abs(share - 1 / count) <= 1 / (2 * count) + 0.05
        for n in graph.nodes:   # a source sits with its first reader
            if n.is_source and graph.users[n.name]:
                assert seg[n.name] == seg[graph.users[n.name][0]]
        if count > 1:   # between transformer blocks only the residual stream crosses
            crossing = {(n.name, u) for n in ops for u in graph.users[n.name]
                        if seg[u] != seg[n.name]}
            assert len({v for v, _ in crossing}) <= count - 1, crossing
    with pytest.raises(ValueError, match="segments must be between 1 and"):
        cut_segments(graph, 0)


def test_segment_lp_balances_each_segment_on_its_own_terms() -> None:
    # Two devices, one 3x faster at segment 0's work, equal at segment 1's: one ratio set
    # must compromise, two sets balance both (exactly: each segment's time equalized).
    devices = [Device(1.0), Device(1.0)]
    phases = [Phase(0.0, split_s=(1.0, 3.0), segment=0), Phase(0.0, split_s=(2.0, 2.0),
                                                               segment=1)]
    two = balance(phases, devices, [0.0, 0.0])
    assert two.segments[0] == pytest.approx((0.75, 0.25))
    assert two.segments[1] == pytest.approx((0.5, 0.5))
    one = balance([dataclasses.replace(p, segment=0) for p in phases], devices)
    assert two.step_s == pytest.approx(0.75 + 1.0)
    assert one.step_s > two.step_s * 1.05
    assert step_time(phases, devices, two.segments) == pytest.approx(two.step_s)


class HalfAndHalf(nn.Module):
    """A matmul-bound half (wide linears), then a memory-bound half (an elementwise chain)."""

    def __init__(self, hidden: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lin:
            x = torch.relu(lin(x))
        for _ in range(self.depth):
            x = torch.tanh(x * 1.01 + 0.1)
        return x


def compute_vs_memory() -> Cluster:
    """Two devices 8x faster at matmuls than two others, all four of equal memory bandwidth."""
    def device(name: str, flops: float) -> DeviceType:
        return DeviceType(name, {"float32": flops}, 16 * 2**30, 1e11, 1.0, 1.0)
    link = Link(100e9, 1e-7)
    return mixed_cluster("compute-vs-memory", [[device("matmul-fast", 8e12)] * 2,
                                               [device("plain", 1e12)] * 2], link, link)


def test_planner_takes_segments_where_they_pay_and_trains_them() -> None:
    model = HalfAndHalf()
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    cl = compute_vs_memory()
    loss = nn.MSELoss()   # one loss object: meshplan's capture memo then traces the model once

    def planned_with(**kw: object) -> meshplan.Plan:
        return meshplan.plan(model, loss, SGD, (x, y), cl, method="hetero",
                             memory_budget_gb=0, **kw)

    one, two = planned_with(), planned_with(segments=2)
    record = two.options["hetero"]["segments"]
    assert record["kept"] and len(two.segment_weights) == 2
    fast, plain = two.segment_weights[0][1][0], two.segment_weights[0][1][2]
    assert fast > 2 * plain                                  # the matmuls go to the fast ones
    assert two.segment_weights[1][1] == pytest.approx((0.25,) * 4)   # bandwidth-bound: even
    assert two.predicted["step_time_s"] < 0.95 * one.predicted["step_time_s"]
    assert record["one_set_step_s"] == pytest.approx(one.predicted["step_time_s"])
    # The simulator prices each collective on its segment's shares: it agrees.
    assert simulate(two).step_time_s == pytest.approx(two.predicted["step_time_s"], rel=1e-6)
    assert "per model segment" in two.explain()
    # And the plan trains like one device (emulated ranks, 3 steps).
    data = [(torch.randn(64, 256), torch.randn(64, 256)) for _ in range(3)]
    w = Workload(model, loss, (x, y), "half-and-half")
    ref = reference(w, SGD, data)
    for result in run_emulated(train_rank, (1, 4), two, w, data, capture(model, loss, (x, y))):
        assert_matches(result, ref, two, SGD)


def test_segments_that_do_not_pay_are_left_out() -> None:
    # Four devices whose speeds keep one ratio at every op: segments only add re-cuts.
    plan = segment_plan(MODELS["bert"], sets=None, segments=3)
    record = plan.options["hetero"]["segments"]
    assert not record["kept"] and not plan.segment_weights
    assert record["step_s"] >= record["one_set_step_s"] * (1 - 1e-9)
    assert "one set kept" in plan.explain()


@pytest.mark.parametrize("kw,match", [
    (dict(method="intra-only", segments=2), "apply to method 'hetero'"),
    (dict(method="hetero", segments=0), "segments must be an int >= 1"),
    (dict(method="hetero", segment_ratios=[[1, 2, 3]]), "one list of 4 non-negative"),
    (dict(method="hetero", segment_ratios=[[1, 1, 1, 1]] * 2, segments=3),
     "segments=3 but segment_ratios gives 2"),
    (dict(method="hetero", segment_ratios=[[1, 1, 1, 1]], axis_weights=((1.0,), (1, 1, 1, 1))),
     "not both"),
])
def test_bad_segment_settings_are_refused(kw: dict, match: str) -> None:
    w = build_workload(MODELS["mlp"], device="meta")
    with pytest.raises(ValueError, match=match):
        meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, four_speeds(),
                      memory_budget_gb=0, **kw)


def test_every_rank_lowers_segments_whose_pieces_add_up() -> None:
    # Whatever the ratios, each rank's pieces of every value add up to the whole, and a
    # value read in another segment is cut there by that segment's ratios.
    spec = MODELS["moe"]
    plan = segment_plan(spec)
    traced, graph = cpu_capture(spec)
    for rank in range(4):
        program = lower(traced, graph, plan, rank, plan.axis_weights)
        for v in program.values.values():
            for n, pieces in zip(v.shape, v.pieces):
                assert pieces is None or sum(pieces) == n


def test_resplit_is_recorded_as_one_all_to_all_of_the_whole_tensor() -> None:
    from meshplan.runtime.collectives import resplit

    def body(comm):  # type: ignore[no-untyped-def]
        x = torch.ones(3 if comm.rank == 0 else 1, 2)
        resplit(comm, x, (1,), 0, (3, 1), (2, 2))
        return comm.records

    for records in run_emulated(body, (1, 2)):
        assert records == [CollectiveRecord("resplit", 32, (1,), "forward")]
    assert CollectiveEntry("resplit", 32, (1,), "forward", 1).segment == 0
