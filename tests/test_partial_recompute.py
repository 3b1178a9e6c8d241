"""Selective and partial recomputation as plan choices (issue 25.4): a plan or pipeline stage
replays only its attention cores (Megatron-LM's selective recomputation) or its first K layers
(its "block" method). Each equals one device with the plan's collectives (emulated and gloo),
the simulated peak is within 10 % of the one PyTorch's profiler measures, and the planner
weighs the kinds per stage against the memory budget."""

from __future__ import annotations

import functools
import math

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.plan.plan import plan_from_json
from meshplan.planner.recompute import (NoReplayError, Replay, attention_cores,
                                        parse_recompute, recomputed_segments)
from meshplan.runtime.emulated import run_emulated
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import build_workload
from oracle import ADAMW, SGD, assert_matches, batches, reference, train_rank
import test_pipeline_runtime as pipelines
from test_recompute_memory import check_two_stage_peak
from test_sim_memory import measured_peak

# Attention scores materialized (flash=0): the cores hold (batch, heads, seq, seq) values.
GPT = "gpt:hidden=32,layers=4,heads=4,seq=16,vocab=64,batch=8,flash=0"
BIG = "gpt:hidden=64,layers=4,heads=4,seq=128,vocab=512,batch=16,flash=0"
BIG8 = BIG.replace("layers=4", "layers=8")
MiB = 2 ** 20


@functools.cache
def _graph(spec: str):
    w = build_workload(spec, device="meta")
    return capture(w.model, w.loss_fn, w.example_batch)[1]


@functools.cache
def _data(spec: str):
    w = build_workload(spec, device="cpu", seed=0)
    return w, batches(w, 3)


@functools.cache
def _oracle(spec: str):
    w, data = _data(spec)
    return reference(w, SGD, data, microbatches=2)


# ---------------------------------------------------------------- what is replayed

def test_one_attention_core_per_block_from_the_scores_to_the_context() -> None:
    g = _graph(GPT)
    cores = attention_cores(g)
    assert len(cores) == 4
    for core in cores:
        ops = sorted(g.by_name[n].op for n in core)
        assert ops.count("matmul") == 2 and "softmax" in ops
        # q, k and v come from outside: the weights' matmuls are not replayed.
        assert not any(g.by_name[n].op == "mm" for n in core)
    # Fused attention keeps no scores; an MLP has no attention at all.
    assert attention_cores(_graph(GPT.replace("flash=0", "flash=1"))) == []
    assert attention_cores(_graph("mlp:layers=2,hidden=16,batch=8")) == []


def test_the_first_k_layers_of_a_stage_and_what_it_sends_with_its_last() -> None:
    g = _graph(GPT)
    layer_of = {n.name: min(3, 4 * i // len(g.nodes)) for i, n in enumerate(g.nodes)}
    first_two = recomputed_segments(g, layer_of, "layers", 2)
    assert set(first_two.values()) == {0, 1}
    assert set(first_two) == {n for n, j in layer_of.items() if j < 2}
    everything = recomputed_segments(g, layer_of)
    assert set(everything) == set(layer_of)
    # A node the clustering lacks (a stage's sink) is in its latest input's layer.
    sink = g.nodes[-1]
    partial = {k: v for k, v in layer_of.items() if k != sink.name}
    assert recomputed_segments(g, partial)[sink.name] == max(
        layer_of[x] for x in sink.inputs)


def test_a_later_stage_replays_its_own_first_layers() -> None:
    # A stage receives values of earlier layers (the previous stage's output; in Hugging Face
    # models the mask and rotary tables made in layer 0): its first layers are the first its
    # ops compute, not those.
    from meshplan.capture.batch import split_microbatches
    from meshplan.lower.pipeline_program import recompute_layers, stage_graphs
    import test_hf_models as hf
    gpt = build_workload(GPT, device="meta")
    for model, loss_fn, example in [(gpt.model, gpt.loss_fn, gpt.example_batch),
                                    (hf.build("llama"), None, hf.batch("llama", 0))]:
        plan = api.plan(model, loss_fn, SGD, example, "local:2",
                        method="megatron:dp=1,tp=1,pp=2", memory_budget_gb=0,
                        recompute="layers:1", dtype="fp32")
        graph = capture(model, loss_fn, split_microbatches(example, plan.microbatches)[0])[1]
        layer_of = recompute_layers(graph, plan)
        for stage, g in zip(plan.stages, stage_graphs(graph, plan)):
            ops = [n.name for n in g.nodes if n.role == "op" and n.name in layer_of]
            first = min(layer_of[n] for n in ops)
            replayed = Replay("layers", 1).segments(g, layer_of)
            assert set(replayed) & set(ops) == {n for n in ops if layer_of[n] == first}, \
                stage.index


def test_the_recompute_argument() -> None:
    assert parse_recompute("selective") == ("full", Replay("attention"))
    assert parse_recompute("layers:3") == ("full", Replay("layers", 3))
    assert parse_recompute("none")[0] == "none" and parse_recompute("auto")[0] == "auto"
    for bad in ("layers:0", "layers:x", "some"):
        with pytest.raises(ValueError, match="recompute"):
            parse_recompute(bad)
    with pytest.raises(ValueError, match="scope"):
        Replay("heads")


# ---------------------------------------------------------------- equal to one device

def _plan(spec: str, shape, method: str, recompute: str, **kw):
    w = build_workload(spec, device="meta")
    extra = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
    return api.plan(w.model, w.loss_fn, SGD, w.example_batch, f"local:{math.prod(shape)}",
                    mesh_shape=shape, method=method, memory_budget_gb=0, microbatches=2,
                    recompute=recompute, name=spec, **extra, **kw)


CASES = [(shape, method, rc) for shape, method in (((1, 2), "megatron"), ((2, 2), "auto"),
                                                     ((1, 2), "data"))
         for rc in ("selective", "layers:2")] + [((1, 2), "megatron", "layers:1")]


@pytest.mark.parametrize("shape,method,recompute", CASES)
def test_a_partial_replay_equals_one_device(shape, method: str, recompute: str) -> None:
    plan = _plan(GPT, shape, method, recompute)
    scope, layers = ("attention", None) if recompute == "selective" else \
        ("layers", int(recompute.split(":")[1]))
    assert plan.recompute and (plan.recompute_scope, plan.recompute_layers) == (scope, layers)
    forward = sum(c.count for c in plan.collectives if c.phase == "forward")
    again = sum(c.count for c in plan.collectives if c.phase == "recompute")
    assert again <= forward   # only what the replayed nodes issue runs again
    w, data = _data(GPT)
    for r in run_emulated(train_rank, shape, plan, w, data):
        assert_matches(r, _oracle(GPT), plan, SGD)   # losses, parameters, collectives


def test_replaying_part_of_the_program_replays_only_its_collectives() -> None:
    full, first = _plan(GPT, (1, 2), "megatron", "full"), _plan(GPT, (1, 2), "megatron",
                                                               "layers:1")
    count = (lambda p: sum(c.count for c in p.collectives if c.phase == "recompute"))
    assert 0 < count(first) < count(full)
    # Selective: Megatron's cores are split by heads, nothing to communicate in them.
    assert count(_plan(GPT, (1, 2), "megatron", "selective")) == 0
    assert first.predicted["replay_flops"] < full.predicted["replay_flops"]
    assert first.predicted["step_time_s"] < full.predicted["step_time_s"]


@pytest.mark.parametrize("recompute", ["selective", "layers:1"])
@pytest.mark.parametrize("method,devices", [("megatron:dp=1,tp=1,pp=2", 2),
                                            ("megatron:dp=1,tp=2,pp=2", 4)])
def test_pipeline_stages_replay_part_of_themselves_equal_to_one_device(
        method: str, devices: int, recompute: str) -> None:
    pipelines._check(GPT, method, devices, "1f1b", 4, SGD, recompute=recompute)


def _gloo(rank: int, nprocs: int, plan, data) -> tuple:
    from meshplan.runtime.comm import ProcessGroupComm
    w, _ = _data(GPT)
    return train_rank(ProcessGroupComm(plan.mesh_shape), plan, w, data)


def test_selective_recomputation_on_gloo(pool2) -> None:
    plan = _plan(GPT, (1, 2), "megatron", "selective")
    _, data = _data(GPT)
    for r in pool2.run(_gloo, plan, data):
        assert_matches(r, _oracle(GPT), plan, SGD)


def test_a_plan_names_its_replay_in_json() -> None:
    plan = _plan(GPT, (1, 2), "megatron", "layers:2")
    again = plan_from_json(plan.to_json())
    assert (again.recompute_scope, again.recompute_layers) == ("layers", 2)


# ---------------------------------------------------------------- memory as measured

@pytest.mark.parametrize("recompute", ["selective", "layers:2"])
def test_one_stage_simulated_peak_is_measured(pool2, recompute: str) -> None:
    w = build_workload(BIG, device="meta")
    plain = api.plan(w.model, w.loss_fn, ADAMW, w.example_batch, "local:2", mesh_shape=(1, 2),
                     method="data", memory_budget_gb=0, recompute="none", name=BIG)
    plan = api.plan(w.model, w.loss_fn, ADAMW, w.example_batch, "local:2", mesh_shape=(1, 2),
                    method="data", memory_budget_gb=0, recompute=recompute, name=BIG)
    simulated = simulate(plan).peak_memory_bytes
    assert max(simulated) < 0.85 * max(simulate(plain).peak_memory_bytes)
    data = batches(build_workload(BIG, device="cpu", seed=0), 2)
    for rank, peak in enumerate(pool2.run(measured_peak, plan, BIG, data)):
        assert simulated[rank] == pytest.approx(peak, rel=0.10), (rank, simulated[rank], peak)


@pytest.mark.parametrize("recompute", ["selective", "layers:2"])
def test_two_stage_simulated_peak_is_measured(pool2, recompute: str) -> None:
    plan = check_two_stage_peak(pool2, BIG8, recompute)
    assert all(s.recompute for s in plan.stages)


# ---------------------------------------------------------------- the planner's choice

def _auto_pipeline(budget_mib: float):
    w = build_workload(BIG8, device="meta")
    return api.plan(w.model, w.loss_fn, ADAMW, w.example_batch, "local:2",
                    method="megatron:dp=1,tp=1,pp=2", microbatches=4, recompute="auto",
                    memory_budget_gb=budget_mib / 1024, dtype="fp32", name=BIG8)


def test_the_planner_replays_per_stage_only_what_memory_demands() -> None:
    def kinds(plan):
        return [(s.recompute_scope, s.recompute_layers) if s.recompute else None
                for s in plan.stages]
    roomy, tight, tighter = _auto_pipeline(40), _auto_pipeline(24), _auto_pipeline(12)
    assert kinds(roomy) == [None, None]
    # The first stage holds two micro-batches under 1F1B: it replays its attention cores,
    # the cheapest replay that fits; the last stage holds one and replays nothing.
    assert kinds(tight) == [("attention", None), None]
    assert kinds(tighter) == [("layers", None), ("layers", None)]
    steps = [p.predicted["step_time_s"] for p in (roomy, tight, tighter)]
    assert steps == sorted(steps)
    for plan, budget in ((tight, 24), (tighter, 12)):
        assert max(simulate(plan).peak_memory_bytes) <= budget * MiB


# ---------------------------------------------------------------- refused, clearly

def test_what_a_partial_replay_refuses() -> None:
    flash = GPT.replace("flash=0", "flash=1")
    with pytest.raises(NoReplayError, match="no attention core"):
        _plan(flash, (1, 2), "megatron", "selective")
    with pytest.raises(NoReplayError, match="ZeRO-3"):
        _plan(GPT, (1, 2), "zero3", "layers:2")


# ---------------------------------------------------------------- random plans

RANDOM_SHAPES = [(1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=[f"{r}x{c}" for r, c in RANDOM_SHAPES])
def test_random_plans_replaying_part_of_themselves_equal_one_device(
        shape, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random valid assignments of the ILP (`random_plans.py`), each with a random partial
    replay and micro-batch count: every one trains as one device, with the collectives its
    plan lists (those of the replayed nodes twice)."""
    import random
    from random_plans import random_plan
    meta = build_workload(GPT, device="meta")
    w, data = _data(GPT)
    rng = random.Random(sum(shape))
    for seed in range(3):
        recompute = rng.choice(["selective", "layers:1", "layers:3"])
        plan = random_plan(meta.model, meta.loss_fn, SGD, meta.example_batch, shape,
                           100 * shape[0] + 10 * shape[1] + seed, monkeypatch,
                           abstract=seed % 2 == 1, recompute=recompute, microbatches=2)
        assert plan.recompute
        for r in run_emulated(train_rank, shape, plan, w, data):
            assert_matches(r, _oracle(GPT), plan, SGD)


# ---------------------------------------------------------------- dropout inside the cores

def test_replayed_cores_draw_the_same_dropout_masks() -> None:
    """Hugging Face GPT-2 with its eager attention and dropout on: each core multiplies its
    probabilities by a dropout mask, which the replay must draw again exactly."""
    import torch
    import transformers
    from meshplan.zoo.spec import Workload
    import test_hf_models as hf
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=hf.VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        attn_implementation="eager")).train()
    example, data = hf.batch("gpt2", 0), [hf.batch("gpt2", s) for s in range(2)]
    g = capture(model, None, example)[1]
    cores = attention_cores(g)
    assert len(cores) == 2 and model.config.attn_pdrop > 0
    assert all("mul" in {g.by_name[n].op for n in core} for core in cores)   # the mask
    w = Workload(model, None, example, "gpt2-eager")
    runs = {}
    for recompute in ("none", "selective"):
        plan = api.plan(model, None, SGD, example, "local:2", mesh_shape=(1, 2),
                        method="megatron", memory_budget_gb=0, recompute=recompute,
                        microbatches=2)
        runs[recompute] = run_emulated(train_rank, (1, 2), plan, w, data)[0]
    assert runs["selective"][0] == runs["none"][0]   # bit for bit: the same masks
    for name, p in runs["none"][1].items():
        assert torch.equal(runs["selective"][1][name], p), name
