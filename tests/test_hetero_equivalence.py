"""Uneven shards train exactly like one device (issue 10's acceptance): synthesized programs
with ratios 0.4/0.3/0.2/0.1 on 4 gloo processes for an MLP, a BERT-like transformer and an
MoE transformer, under each way of gathering uneven shards; and random valid programs with
random uneven ratios on emulated ranks."""

from __future__ import annotations

import dataclasses
import random

import pytest

import meshplan
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from hetero_cases import MODELS, RATIOS, four_speeds, planned, train_gloo, without_bytes
from oracle import (assert_matches, cpu_capture, meta_workload, reference, seeded_run,
                    shared_capture, train_rank)
from random_plans import random_plan

SGD = OptimizerSpec("sgd", lr=0.05)


def hetero_plan(spec: str, gather: str, ratios=RATIOS, sfb: str = "auto") -> meshplan.Plan:
    w = meta_workload(spec)   # one meta model per spec: its capture is made once
    return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, four_speeds(),
                         method="hetero", axis_weights=ratios, memory_budget_gb=0,
                         gather=gather, name=spec, sfb=sfb)


@pytest.mark.parametrize("sfb", ["auto", "force"])
@pytest.mark.parametrize("gather", ["padded", "broadcast"])
@pytest.mark.parametrize("name", list(MODELS))
def test_synthesized_program_with_uneven_ratios_on_gloo(pool4, name: str, gather: str,
                                                        sfb: str) -> None:
    # "auto": the synthesized program as is; "force": every matmul weight by SFB, its factors
    # gathered unevenly in backward.
    spec = MODELS[name]
    plan = hetero_plan(spec, gather, sfb=sfb)
    assert plan.axis_weights[1] == pytest.approx(RATIOS[1]) and plan.mesh_shape == (1, 4)
    assert any(o.strategy != "replicated" for o in plan.ops), "the program splits work"
    assert (sfb == "force") <= any(p.update == "sfb" for p in plan.params)
    _, data, ref = seeded_run(spec, SGD)   # the seeded workload's 3 batches and oracle result
    for result, used in pool4.run(train_gloo, plan, spec, data):
        assert_matches(result, ref, plan, SGD)
        # Uneven shards are gathered as the plan chose (fixed-size exchanges, such as the
        # maxima of a softmax over split classes, are even and stay padded).
        gathers = {impl for (kind, impl) in used if kind in ("all_gather", "reduce_scatter")}
        if gather == "padded":
            assert gathers <= {"padded"}, used
        elif any(c.kind in ("all_gather", "reduce_scatter") for c in plan.collectives):
            assert "broadcast" in gathers, used


def test_each_gather_choice_runs_where_the_plan_has_uneven_gathers() -> None:
    # The synthesized MLP and MoE programs gather and scatter uneven shards (the MoE's experts
    # with an all-to-all too), so the gloo runs above do run each way of gathering them.
    kinds = {m: {c.kind for c in hetero_plan(MODELS[m], "padded").collectives}
             for m in ("mlp", "moe")}
    assert {"all_gather", "reduce_scatter"} <= kinds["mlp"], kinds
    assert {"all_gather", "reduce_scatter", "all_to_all"} <= kinds["moe"], kinds


RANDOM_CASES = [("mlp", (1, 4), 4), ("bert", (1, 4), 3), ("moe", (1, 4), 3), ("mlp", (2, 2), 3),
                ("moe", (2, 2), 2)]


@pytest.mark.parametrize("name,shape,seeds", RANDOM_CASES,
                         ids=[f"{n}-{r}x{c}" for n, (r, c), _ in RANDOM_CASES])
def test_random_programs_with_random_uneven_ratios(name: str, shape, seeds: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MODELS[name]
    # One meta model, workload, oracle result and capture per spec for all its cases.
    meta = meta_workload(spec)
    w, data, ref = seeded_run(spec, SGD, 2)
    captured = cpu_capture(spec)
    rng = random.Random(f"{name}-{shape}")
    for seed in range(seeds):
        # SFB: "force" draws the rest of the plan around every weight it applies to; "auto"
        # draws it among the other modes (rarely on a 2-D mesh: its consumer must split the
        # batch over both axes).
        sfb = ("force", None, "auto")[seed % 3]
        plan = random_plan(meta.model, meta.loss_fn, SGD, meta.example_batch, shape,
                           500 + seed, monkeypatch, abstract=seed % 2 == 1, sfb=sfb)
        assert (sfb == "force") <= any(p.update == "sfb" for p in plan.params)
        weights = tuple(tuple(rng.choice((1.0, 2.0, 3.0, 5.0)) for _ in range(n))
                        for n in shape)
        plan = dataclasses.replace(plan, axis_weights=weights,
                                   options={**plan.options,
                                            "gather_impl": ("padded", "broadcast")[seed % 2]})
        for losses, params, per_step in run_emulated(train_rank, shape, plan, w, data,
                                                     captured):
            assert_matches((losses, params, [planned(plan)] * len(per_step)), ref, plan, SGD)
            # A gather over one axis of a value also split unevenly over the other moves this
            # rank's piece, not the even size the plan lists: compare all but the bytes.
            for got in per_step:
                assert without_bytes(got) == without_bytes(planned(plan))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_rank_lowers_under_any_mix_of_uneven_axes(name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # One axis uneven and the other even, or both uneven: the pieces an uneven axis cuts are
    # cut again over the other in whole units, so every op's operands agree on every rank
    # (`lower` raises if they do not) and the pieces add up to the whole.
    from meshplan.lower.program import lower
    spec = MODELS[name]
    meta = meta_workload(spec)
    traced, graph = cpu_capture(spec)
    for seed in range(2):   # 501: a MoE plan whose uneven pieces once disagreed
        plan = random_plan(meta.model, meta.loss_fn, SGD, meta.example_batch, (2, 2),
                           500 + seed, monkeypatch, abstract=seed % 2 == 1)
        for a, b in [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0), (5.0, 2.0)]:
            weights = ((a, 1.0), (1.0, b))
            for rank in range(4):
                program = lower(traced, graph, plan, rank, weights)
                for v in program.values.values():
                    for n, pieces in zip(v.shape, v.pieces):
                        assert pieces is None or sum(pieces) == n, (v, weights)


def test_an_op_without_a_signature_is_replicated_not_a_crash() -> None:
    # `linspace` has no dimension signature: synthesis plans it replicated (as the ILP does)
    # and the uneven program around it still trains like one device.
    import warnings

    import torch
    import torch.nn.functional as F
    from test_capture_autograd import Ramp
    from meshplan.zoo.spec import Workload
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(8, 8, generator=g),), torch.randn(8, 8, generator=g))
            for _ in range(3)]
    w = Workload(Ramp(), F.mse_loss, data[0], "ramp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, four_speeds(),
                             method="hetero", axis_weights=RATIOS, memory_budget_gb=0)
    assert "linspace" in plan.options["unsupported_ops"]
    assert any(o.strategy != "replicated" for o in plan.ops)
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, (1, 4), plan, w, data, shared_capture(w)):
        assert_matches(r, ref, plan, SGD)


def test_wide_resnet_with_batch_norm_over_an_uneven_batch() -> None:
    # Batch norm's statistics over a batch cut 0.4/0.3/0.2/0.1, and convolutions split by
    # channels: in float64 (fp32 Wide-ResNet amplifies summation order, as in
    # test_equivalence_zoo) every rank trains like one device to 1e-9.
    import test_equivalence_zoo as zoo
    meta, w = zoo._workload("wresnet", "meta"), zoo._workload("wresnet", "cpu")
    data, ref, captured = zoo._oracle("wresnet")   # at the zoo test's lr, 0.01
    sgd = OptimizerSpec("sgd", lr=0.01)
    assert sgd == zoo.SGD
    plan = meshplan.plan(meta.model, meta.loss_fn, sgd, meta.example_batch, four_speeds(),
                         method="hetero", axis_weights=RATIOS, memory_budget_gb=0)
    assert any(o.op == "batch_norm" and o.strategy != "replicated" for o in plan.ops)
    for r in run_emulated(train_rank, (1, 4), plan, w, data, captured):
        assert_matches(r, ref, plan, sgd, tol=1e-9)
