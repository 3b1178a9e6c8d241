"""Every plan family equals single-device training (emulated ranks: breadth in milliseconds)."""

from __future__ import annotations

import pytest

from meshplan.runtime.emulated import run_emulated
from oracle import (ADAMW, GPT, MLP, SGD, assert_matches, cpu_capture, make_plan, seeded_run,
                    train_rank)

CASES = [(method, shape) for method in ("data", "megatron", "zero2", "zero3")
         for shape in ((1, 2), (1, 4))] + [("megatron", (2, 2)), ("auto", (2, 2))]


def run_case(spec: str, shape: tuple[int, int], method: str, opt, *, abstract: bool = False,
             **kw) -> None:
    plan = make_plan(spec, shape, method, opt, abstract=abstract, **kw)
    w, data, ref = seeded_run(spec, opt)
    results = run_emulated(train_rank, shape, plan, w, data, cpu_capture(spec))
    for r in results:
        assert_matches(r, ref, plan, opt)


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
@pytest.mark.parametrize("method,shape", CASES, ids=[f"{m}-{s[0]}x{s[1]}" for m, s in CASES])
def test_plan_family_matches_single_device_sgd(spec: str, method: str, shape) -> None:
    run_case(spec, shape, method, SGD)


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 2)], ids=["1x2", "1x4", "2x2"])
def test_ilp_plan_matches_single_device(spec: str, shape) -> None:
    # Abstract unit costs make the ILP split every matmul (Alpa's setting), so its own plan
    # exercises tensor parallelism and resharding, not just the cheapest replication.
    run_case(spec, shape, "auto", SGD, abstract=True)


@pytest.mark.parametrize("method,shape", [("data", (1, 4)), ("megatron", (2, 2)),
                                          ("zero2", (1, 4)), ("zero3", (1, 2)),
                                          ("auto", (2, 2))])
def test_adamw_matches_single_device(method: str, shape) -> None:
    run_case(GPT, shape, method, ADAMW, abstract=method == "auto")


def test_uneven_three_to_one_batch_split() -> None:
    run_case(MLP, (1, 2), "data", SGD, axis_weights=((1.0,), (3.0, 1.0)))


def test_uneven_split_really_is_uneven() -> None:
    from meshplan.lower.program import lower
    spec = MLP
    plan = make_plan(spec, (1, 2), "data", SGD, axis_weights=((1.0,), (3.0, 1.0)))
    traced, graph = cpu_capture(spec)
    sizes = []
    for rank in range(2):
        prog = lower(traced, graph, plan, rank, plan.axis_weights)
        x = [n for n in graph.nodes if n.role == "input"][0]
        sizes.append(prog.values[x.name].pieces[0])
    assert sizes[0] == (6, 2) and sizes[1] == (6, 2)


def test_sgd_nesterov_momentum_matches_single_device() -> None:
    # Alpa's Wide-ResNet optimizer: elementwise, so torch's own SGD steps each shard.
    from meshplan.runtime.optim import OptimizerSpec
    nesterov = OptimizerSpec("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    run_case(GPT, (2, 2), "auto", nesterov, abstract=True)
    run_case(MLP, (1, 4), "zero2", nesterov)


@pytest.mark.parametrize("experts,split", [(8, "S01"), (4, "S1"), (6, "S0")])
def test_expert_parallelism_where_the_expert_count_divides_part_of_the_mesh(experts, split):
    # DeepSpeed's expert-parallel degree divides the expert count: on a (2, 4) mesh 8 experts
    # take every device, 4 the larger axis, 6 the smaller; the rest hold ZeRO-2 replicas.
    spec = f"moe:hidden=16,layers=2,heads=2,experts={experts},seq=8,vocab=32,batch=8"
    plan = make_plan(spec, (2, 4), "expert", SGD)
    moe = [p for p in plan.params if ".moe." in p.name and not p.name.endswith(".wg")]  # gate: dense
    assert moe and all(p.spec.startswith(split + ",") for p in moe), [p.spec for p in moe]
    run_case(spec, (2, 4), "expert", SGD)
