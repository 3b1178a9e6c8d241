"""Communication overlapped with compute (`lower/overlap.py`, DESIGN.md §8): the groups the plan
makes (gradient buckets, ZeRO-3 units) and their orders, the two-stream timing the planner and
the simulator share, and the runtime following the plan — its asynchronous collectives issued
in the plan's order, buckets launched while the backward still runs, the next unit gathered
while one computes — with every plan still equal to one device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import meshplan
from meshplan.capture.to_ir import capture
from meshplan.lower import overlap as ov
from meshplan.plan.plan import AsyncEntry
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.trainer import Trainer
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import build_workload
from oracle import ADAMW, SGD, assert_matches, batches, make_plan, reference

GPT = "gpt:hidden=32,layers=3,heads=4,seq=8,vocab=64,batch=8"


def _param(name: str, state: str, first: int, nbytes: int, axes=(1,), last: int | None = None
           ) -> ov.GroupParam:
    return ov.GroupParam(name, state, axes, "float32", nbytes,
                         ov.ParamUse(first, first if last is None else last))


# ---------------------------------------------------------------- grouping
def test_buckets_fill_in_gradient_order_with_a_small_first_one() -> None:
    params = [_param(f"p{i}", f"layers.{i}.w", first=i, nbytes=400) for i in range(10)]
    buckets = ov.grad_buckets(params, bucket_bytes=1000, first_bucket_bytes=500)
    # Gradients complete from the last-used parameter back: p9 first, in buckets of <= 1000
    # bytes after a first of <= 500.
    assert [b.params for b in buckets] == [("p9",), ("p8", "p7"), ("p6", "p5"), ("p4", "p3"),
                                           ("p2", "p1"), ("p0",)]
    assert [b.bytes for b in buckets] == [400, 800, 800, 800, 800, 400]
    # A parameter larger than a bucket gets one of its own; axes and dtypes never mix.
    big = [_param("a", "a", 0, 5000), _param("b", "b", 1, 10, axes=(0,)),
           _param("c", "c", 2, 10)]
    got = ov.grad_buckets(big, bucket_bytes=1000, first_bucket_bytes=500)
    assert sorted(b.params for b in got) == [("a",), ("b",), ("c",)]
    assert [b.params for b in got] == [("c",), ("b",), ("a",)]   # in completion order


def test_zero3_units_are_a_blocks_consecutive_parameters() -> None:
    assert ov.block_of("model.layers.3.mlp.up.weight") == "model.layers.3"
    assert ov.block_of("blocks.0.experts.2.w1") == "blocks.0"
    assert ov.block_of("tok_emb.weight") == "tok_emb.weight"
    params = [_param("e", "emb.weight", 0, 8), _param("a0", "blocks.0.attn.w", 1, 8),
              _param("m0", "blocks.0.mlp.w", 2, 8), _param("a1", "blocks.1.attn.w", 3, 8),
              _param("x1", "blocks.1.mlp.w", 4, 8, axes=(0, 1)),
              _param("m1", "blocks.1.mlp.b", 5, 8), _param("n", "norm.weight", 6, 8),
              _param("h", "head.weight", 7, 8)]
    units = ov.zero3_units(params)
    assert [u.params for u in units] == [("e",), ("a0", "m0"), ("a1",), ("x1",), ("m1",),
                                         ("n",), ("h",)]
    assert units[1].bytes == 16


def test_unit_orders_follow_the_backward() -> None:
    # A tied embedding: used first (lookup) and last (the LM head) in the forward, so the
    # backward needs it first, and its gradient completes last.
    uses = {"emb": ov.ParamUse(0, 9), "b0": ov.ParamUse(2, 3), "b1": ov.ParamUse(5, 6)}
    units = [ov.SyncGroup(("emb",), (1,), 8), ov.SyncGroup(("b0",), (1,), 8),
             ov.SyncGroup(("b1",), (1,), 8)]
    regather, scatter = ov.unit_orders(units, uses, lambda p: p != "b0")
    assert regather == (0, 2)           # b0 is not kept: never gathered again
    assert scatter == (2, 1, 0)


def test_prefetch_and_launch_times() -> None:
    # Needed at 0, 1, 3, 6: with depth 1 item k is issued when item k - 1 is needed.
    assert ov.prefetched([5, 6, 7, 8], [0.0, 1.0, 3.0, 6.0], 1) == [
        (5, 0.0), (6, 0.0), (7, 1.0), (8, 3.0)]
    # Launched in order, each once ready and after the one before it.
    assert ov.launched([0, 1, 2], [2.0, 1.0, 5.0]) == [(0, 2.0), (1, 2.0), (2, 5.0)]


# ---------------------------------------------------------------- timing
def _entry(during: str, issue: float, wait: float | None = None, nbytes: int = 1) -> AsyncEntry:
    return AsyncEntry("all_gather", nbytes, (1,), during, issue, wait)


def test_async_pass_by_hand() -> None:
    def cost(e: AsyncEntry) -> float:
        return float(e.bytes)

    # Two gathers of 2 s each, both issued at once, needed after 0 and 1 s of a 3 s compute:
    # the first is waited for (0-2), the second runs 2-4 while the compute's first second runs
    # 2-3, the compute waits for it until 4, then runs its last 2 s: 6 s.
    fwd = [_entry("forward", 0.0, 0.0, 2), _entry("forward", 0.0, 1.0, 2)]
    assert ov.async_pass(3.0, fwd, cost) == (6.0, 6.0)
    # A reduce-scatter drained at the end outlasts the compute by its tail.
    assert ov.async_pass(3.0, [_entry("backward", 2.5, None, 2)], cost) == (4.5, 4.5)
    # A bucket is not waited for by the backward: its tail is the update's.
    assert ov.async_pass(3.0, [_entry("last_backward", 2.5, None, 2)], cost) == (3.0, 4.5)
    # One stream: the second waits for the first.
    two = [_entry("last_backward", 0.0, None, 2), _entry("last_backward", 1.0, None, 2)]
    assert ov.async_pass(3.0, two, cost) == (3.0, 4.0)


def test_buckets_overlapped_make_the_update_shorter_as_simulated() -> None:
    """A data-parallel GPT on one host: its buckets run under the backward, so the update the
    simulator charges is less than all of them one after another, and the planner's estimate
    is the simulator's."""
    spec = "gpt:hidden=512,layers=8,heads=8,seq=128,vocab=1024,batch=64"
    w = build_workload(spec, device="meta")
    plan = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1",
                         mesh_shape=(1, 8), method="data", memory_budget_gb=0)
    assert len(plan.buckets) > 2
    assert all(e.during == "last_backward" for e in plan.overlap)
    sim = simulate(plan)
    assert sim.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    from meshplan.cost.collectives import collective_cost
    from meshplan.cost.cluster import cluster_from_dict
    from meshplan.cost.mesh import logical_mesh
    mesh = logical_mesh(cluster_from_dict(plan.cluster), plan.mesh_shape)
    serial = sum(collective_cost("all_reduce", mesh, b.axes, b.bytes) for b in plan.buckets)
    f, b, update = ov.step_passes(plan.predicted["forward_s"], plan.predicted["backward_s"],
                                  plan.collectives, plan.overlap, [mesh], plan.microbatches)
    assert 0 < update < 0.5 * serial


# ---------------------------------------------------------------- the runtime follows
def _async_sequences(records, plan) -> dict[str, list]:
    """The runtime's overlapped collectives in the order it issued them, by category."""
    unit_bytes = {u.bytes for u in plan.units}
    out: dict[str, list] = {"buckets": [], "gathers": [], "regathers": [], "scatters": []}
    for r in records:
        key = (r.nbytes, tuple(r.axes))
        if r.kind == "all_reduce" and r.phase == "update":
            out["buckets"].append(key)
        elif r.kind == "all_gather" and r.nbytes in unit_bytes:
            out["gathers" if r.phase == "forward" else "regathers"].append(key)
        elif r.kind == "reduce_scatter" and r.nbytes in unit_bytes:
            out["scatters"].append(key)
    return out


def _planned_sequences(plan, microbatches: int) -> dict[str, list]:
    u = plan.units
    return {"buckets": [(b.bytes, b.axes) for b in plan.buckets],
            "gathers": [(g.bytes, g.axes) for g in u] * microbatches,
            "regathers": [(u[i].bytes, u[i].axes) for i in plan.unit_regather] * microbatches,
            "scatters": [(u[i].bytes, u[i].axes) for i in plan.unit_scatter] * microbatches}


def _one_step(comm, plan, w, batch, captured) -> tuple:
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    early = []
    original = tr._buckets.finish

    def finish() -> None:   # how many buckets were launched before the update waited
        early.append(tr._buckets._order.next)
        original()
    tr._buckets.finish = finish
    ahead = []
    if tr._units is not None:
        forward = tr._units.forward_members

        def counting(u: int):
            out = forward(u)
            ahead.append(len(tr._units._ahead))
            return out
        tr._units.forward_members = counting
    tr.step(batch)
    return list(comm.records), early[0], ahead


WIDE = "gpt:hidden=256,layers=2,heads=4,seq=8,vocab=64,batch=8"   # 6 MB: two buckets


@pytest.mark.parametrize("spec,method,shape,microbatches", [
    (WIDE, "data", (1, 4), 1), (GPT, "zero3", (1, 4), 2), (GPT, "zero3", (2, 2), 1),
    (GPT, "intra-only", (2, 2), 2)])
def test_the_runtime_issues_overlapped_collectives_in_the_plans_order(
        spec: str, method: str, shape, microbatches: int) -> None:
    plan = make_plan(spec, shape, method, ADAMW, microbatches=microbatches)
    if method == "data":
        assert len(plan.buckets) == 2
    w = build_workload(spec, device="cpu", seed=0)
    captured = capture(w.model, w.loss_fn, w.example_batch if microbatches == 1 else
                       _micro(w, microbatches))
    results = run_emulated(_one_step, plan.mesh_shape, plan, w, batches(w, 1)[0], captured)
    want = _planned_sequences(plan, microbatches)
    for records, early, ahead in results:
        got = _async_sequences(records, plan)
        assert got == want
        if len(plan.buckets) > 1:
            # Launched as the backward completed them: all but what the last ops make.
            assert early >= 1
        if plan.units and len(plan.units) > 1:
            # The next unit was in flight while one computed (the last has none after it).
            assert max(ahead) == plan.prefetch


def _micro(w, m: int):
    from meshplan.capture.batch import split_microbatches
    return split_microbatches(w.example_batch, m)[0]


def test_zero3_units_train_like_one_device_with_sgd() -> None:
    """Units gathered, prefetched and reduce-scattered as one: the step is still exact."""
    plan = make_plan(GPT, (2, 2), "zero3", SGD, microbatches=2)
    assert any(len(u.params) > 1 for u in plan.units)
    w = build_workload(GPT, device="cpu", seed=0)
    data = batches(w, 3)
    ref = reference(w, SGD, data, microbatches=2)
    from oracle import train_rank
    captured = capture(w.model, w.loss_fn, _micro(w, 2))
    for result in run_emulated(train_rank, plan.mesh_shape, plan, w, data, captured):
        assert_matches(result, ref, plan, SGD)


def test_a_plan_without_groups_runs_as_older_meshplans_did() -> None:
    """A version-2 plan (no buckets, no units): one bucket per axes after the backward, one
    unit per ZeRO-3 parameter; what runs is what it lists."""
    from dataclasses import replace
    plan = make_plan(GPT, (1, 2), "zero3", SGD)
    old = replace(plan, buckets=(), units=(), unit_regather=(), unit_scatter=(), overlap=())
    w = build_workload(GPT, device="cpu", seed=0)
    captured = capture(w.model, w.loss_fn, w.example_batch)
    results = run_emulated(_one_step, old.mesh_shape, old, w, batches(w, 1)[0], captured)
    gathers = Counter((r.kind, r.phase) for r in results[0][0] if r.kind == "all_gather")
    zero3 = sum(p.update == "zero3" and bool(p.sync_axes) for p in plan.params)
    assert gathers[("all_gather", "forward")] == zero3


def _accumulating(comm, plan, w, data, captured) -> tuple:
    """The user's loop accumulating gradients over two calls before one optimizer step."""
    import copy
    model = copy.deepcopy(w.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = meshplan.parallelize(model, opt, plan, w.loss_fn, comm=comm, captured=captured)
    for first, second in zip(data[::2], data[1::2]):
        model(first).backward()
        model(second).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


@pytest.mark.parametrize("method,shape", [("data", (1, 4)), ("zero2", (1, 4)),
                                          ("zero3", (2, 2))])
def test_gradients_accumulated_over_the_callers_own_calls(method: str, shape) -> None:
    """Two ``model(batch)``/``loss.backward()`` before one ``optimizer.step()``: buckets
    launched by the first backward are superseded, reduce-scatters issued by the first are
    finished before the second forward; the sum of both batches' gradients is applied, as on
    one device."""
    import copy
    plan = make_plan(WIDE if method == "data" else GPT, shape, method, SGD)
    spec = WIDE if method == "data" else GPT
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 4)
    ref = copy.deepcopy(w.model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for first, second in zip(data[::2], data[1::2]):
        for (x,), t in (first, second):
            w.loss_fn(ref(x), t).backward()
        opt.step()
        opt.zero_grad()
    captured = capture(w.model, w.loss_fn, w.example_batch)
    for params in run_emulated(_accumulating, plan.mesh_shape, plan, w, data, captured):
        for name, r in ref.named_parameters():
            err = (params[name] - r.detach()).abs().max().item()
            assert err <= 1e-5 * max(r.abs().max().item(), 1e-3), (name, err)


# ---------------------------------------------------------------- priced by the ILP
def test_the_ilp_prices_the_all_reduce_it_overlaps() -> None:
    """Eq. 1 charged the replicated gradients' all-reduce in full, where the runtime hides it
    behind the last backward: on 8 V100 a Wide-ResNet's pure data parallelism priced 0.518 s
    a step ran in 0.457 s, and intra-only's ILP took a ZeRO plan that ran in 0.469 s. With
    the overlap terms (`planner/intra/overlap_terms.py`) the ILP's objective is the plan's
    own prediction within a few percent, and intra-only is no slower than data parallelism."""
    import meshplan.api as api
    from meshplan.runtime.optim import OptimizerSpec
    w = build_workload("wresnet:preset=2b,layers=26,batch=32", device="meta")
    sgd = OptimizerSpec.from_dict({"kind": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True})
    plans = {m: api.plan(w.model, w.loss_fn, sgd, w.example_batch, "p3.16xlarge:1",
                         method=m, microbatches=1, dtype="fp32")
             for m in ("intra-only", "data")}
    for p in plans.values():
        assert p.objective == pytest.approx(p.predicted["step_time_s"], rel=0.02)
    assert plans["intra-only"].predicted["step_time_s"] <= \
        plans["data"].predicted["step_time_s"] * 1.001


@pytest.mark.parametrize("microbatches", [8, 64])
def test_the_ilp_prices_zero2s_reduce_scatters_behind_each_backward(microbatches: int) -> None:
    """ZeRO-2 reduce-scatters every micro-batch's gradients as they complete, behind that
    micro-batch's backward (`extract._sync`). Eq. 1 charged all but the last in full: at 64
    micro-batches a GPT's ZeRO-2 plan priced 12 % over its own prediction, and GPT-6.7B's
    inter-only pipeline (ZeRO-2 stages of 1024 micro-batches) 9 % over its simulated step.
    The ILP's objective is now the plan's prediction within 2 % (1.5 % over at 64 micro-batches
    of one sample, whose backwards each also cast the weights' gradients back to fp32: the
    linear lower bound of the hidden reduce-scatters is looser there)."""
    import meshplan.api as api
    w = build_workload("gpt:hidden=1024,layers=2,heads=16,seq=512,vocab=51200,batch=64",
                       device="meta")
    p = api.plan(w.model, w.loss_fn, "adam", w.example_batch, "p3.16xlarge:1x2",
                 method="zero2", microbatches=microbatches, dtype="fp16")
    assert any(d.update == "zero2" for d in p.params)
    assert p.objective == pytest.approx(p.predicted["step_time_s"], rel=0.02)
