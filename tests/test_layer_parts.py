"""End layers priced in parts (`planner/inter/layer_parts.py`): a part proved equal to the
repeated layer shares its solves, and the layer's price is the sum of its parts'."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.layer_parts import split_layers
from meshplan.planner.inter import stage_costs
from meshplan.planner.inter.stage_costs import StageProfiler, _summed
from meshplan.planner.inter.stage_graph import cut_stage, stage_graph, structure_key
from meshplan.planner.intra.choices import IntraOptions
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=8"
# Four Llama blocks in four layers: the first holds the embedding, the rotary tables and the
# values every block computes alike, which the capture merges into the first block.
LLAMA = "hf:llama-3-70b,layers=4,hidden=64,heads=4,kv=2,ffn=128,vocab=128,batch=2,seq=16"
BUDGET = 3.0 * 2**20


def _program(spec: str, num_layers: int):
    w = build_workload(spec, device="meta")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    graph = with_compute_dtype(graph, "fp16")
    return graph, cluster_layers(graph, num_layers)


@pytest.fixture(scope="module")
def gpt():
    return _program(GPT, 6)


@pytest.fixture(scope="module")
def llama():
    return _program(LLAMA, 4)


def _split(program):
    graph, layering = program
    stages = [stage_graph(graph, layering, m, m + 1) for m in range(layering.num_layers)]
    return split_layers(graph, layering, [structure_key(s) for s in stages],
                        lambda m: stages[m])


def _ops(graph, names) -> set[str]:
    return {x for x in names if graph.by_name[x].role == "op"}


@pytest.mark.parametrize("which,split", [("gpt", [0, 5]), ("llama", [0, 3])])
def test_an_end_layer_splits_into_the_repeated_layer_and_the_rest(request, which: str,
                                                                  split: list[int]) -> None:
    """The layers holding the embedding and the head split in two; one part's program has
    the repeated layer's structure key, its received values in that layer's order; the
    parts of every layer hold exactly its ops, and no first part reads its second."""
    program = request.getfixturevalue(which)
    graph, layering = program
    keys = [structure_key(stage_graph(graph, layering, m, m + 1))
            for m in range(layering.num_layers)]
    common = Counter(keys).most_common(1)[0][0]
    parts = _split(program)
    assert parts is not None
    assert [m for m, (a, b) in enumerate(parts.spans) if b - a == 2] == split
    assert all(b - a in (1, 2) for a, b in parts.spans)
    for m, (a, b) in enumerate(parts.spans):
        held = [_ops(graph, parts.parts.layers[p]) for p in range(a, b)]
        assert set().union(*held) == _ops(graph, layering.layers[m])
        assert sum(map(len, held)) == len(_ops(graph, layering.layers[m]))
        if b - a == 2:
            assert not any(i in held[1] for x in held[0] for i in graph.by_name[x].inputs)
    assert len(parts.programs) == len(split)
    for (p, _), program_of_part in parts.programs.items():
        assert structure_key(program_of_part) == common
        # As cut, the part is the same program with its received values in another order
        # (Llama) or the very same (GPT): either way its ops are those of its part.
        cut = cut_stage(graph, parts.parts.layer_of, p, p + 1)
        assert sorted(n.name for n in cut.nodes) == sorted(n.name for n in program_of_part.nodes)


def test_a_program_without_repeated_layers_does_not_split() -> None:
    assert _split(_program("mlp:layers=6,hidden=256,batch=32", 3)) is None


def _profiler(program, in_parts: bool) -> StageProfiler:
    graph, layering = program
    return StageProfiler(graph, layering, parse_cluster_spec("p3.16xlarge:1x4"),
                         IntraOptions(optimizer="adamw", memory_budget=BUDGET), OptimizerState(),
                         2, BUDGET, in_parts=in_parts)


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_a_split_layer_is_priced_as_its_parts_and_the_others_as_before(request, monkeypatch,
                                                                       which: str) -> None:
    """A split layer's price (where its parts price it: forced here) is the sum of its parts'
    (what the second part receives kept with the activations, the layer's inputs what the
    first receives); the part equal to the repeated layer costs what that layer does; every
    other layer's price is bit for bit what pricing without parts gives."""
    monkeypatch.setattr(stage_costs, "PARTS_BELOW", math.inf)
    monkeypatch.setattr(stage_costs, "PARTS_ABOVE", math.inf)
    program = request.getfixturevalue(which)
    by_parts, whole = _profiler(program, True), _profiler(program, False)
    assert by_parts._parts is not None and whole._parts is None
    spans, pricer = by_parts._parts[0].spans, by_parts._parts[1]
    sub = (1, 4)
    for shape in by_parts.shapes(sub):
        for budget in by_parts.variants(sub, shape):
            for m, (a, b) in enumerate(spans):
                got = by_parts._exact(m, m + 1, sub, shape, budget)
                if b - a == 1:
                    assert got == whole._exact(m, m + 1, sub, shape, budget)
                    continue
                parts = [pricer._exact(p, p + 1, sub, shape, budget) for p in range(a, b)]
                if any(c is None for c in parts):
                    assert got is None
                    continue
                assert got == _summed(parts)
                assert got.inputs == parts[0].inputs
                assert got.act == parts[0].act + parts[1].act + parts[1].inputs
                twin = next(p for p in range(a, b) if (p, p + 1) in by_parts._parts[0].programs)
                repeated = next(mm for mm, (aa, bb) in enumerate(spans) if bb - aa == 1
                                and pricer.key(aa, bb) == pricer.key(twin, twin + 1))
                assert pricer._exact(twin, twin + 1, sub, shape, budget) == \
                    whole._exact(repeated, repeated + 1, sub, shape, budget)
    assert by_parts.solves > 0


def test_small_layers_whose_parts_misprice_them_are_priced_whole(gpt) -> None:
    """In a 64-wide GPT the parts' free boundary decides the plan (the head's layer is 35 %
    cheaper by parts on (1, 2)): the end layers are checked, found apart, and priced whole,
    bit for bit as without parts."""
    by_parts, whole = _profiler(gpt, True), _profiler(gpt, False)
    assert not by_parts._by_parts(0) and not by_parts._by_parts(5)
    assert all(by_parts._by_parts(m) for m in range(1, 5))
    sub = (1, 4)
    for shape in by_parts.shapes(sub):
        for budget in by_parts.variants(sub, shape):
            for m in range(6):
                assert by_parts._exact(m, m + 1, sub, shape, budget) == \
                    whole._exact(m, m + 1, sub, shape, budget)


def test_a_large_layer_is_priced_by_parts_that_agree_with_its_whole_solve() -> None:
    """GPT-39B's widths: its first layer (embedding and a block) by parts within the bounds
    of its whole solve on the sample mesh, so by parts everywhere."""
    program = _program("gpt:preset=39b,batch=2,layers=4", 4)
    prof = StageProfiler(*program, parse_cluster_spec("p3.16xlarge:1x8"),
                         IntraOptions(optimizer="adamw", memory_budget=16 * 2**30),
                         OptimizerState(), 2, 16 * 2**30)
    assert prof._parts is not None and prof._parts[0].spans[0] == (0, 2)
    assert prof._by_parts(0)
    sample = ((1, 2), prof.shapes((1, 2))[0])
    whole = prof._price(0, 1, *sample, "free")
    parts = prof._exact(0, 1, *sample, "free")
    assert (1 - stage_costs.PARTS_BELOW) * whole.latency <= parts.latency <= \
        (1 + stage_costs.PARTS_ABOVE) * whole.latency
    assert parts != whole
