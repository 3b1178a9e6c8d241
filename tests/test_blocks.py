"""Repeated blocks share ILP decisions; on small models the shared optimum is the unshared one."""

from __future__ import annotations

import pytest

from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.mesh import logical_mesh
from meshplan.planner.intra.blocks import repeated_blocks
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import CostContext, formulate
from meshplan.planner.intra.ilp import solve
from meshplan.zoo.spec import build_workload

SMALL = {
    "gpt": ("gpt:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=16", 0.0),
    "moe": ("moe:hidden=64,layers=4,heads=4,experts=8,seq=32,vocab=256,batch=8", 0.0),
    "wresnet": ("wresnet:layers=50,channels=8,width=2,image=32,classes=10,batch=16", 0.01),
    # The first layer's gradient completes last and cannot hide its all-reduce: unshared, it
    # goes tensor parallel (its update sharded too) and the rest data parallel; shared, every
    # layer takes one plan (2.5 % dearer; `api._refine` solves the plan untied).
    "mlp": ("mlp:layers=8,hidden=256,batch=32", 0.03),
}


def _solve(spec: str, share: bool) -> tuple[float, int]:
    w = build_workload(spec)
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    cluster = parse_cluster_spec("p3.16xlarge:1")
    choices = resolve_choices(graph, (2, 4), IntraOptions())
    form = formulate(choices, CostContext(logical_mesh(cluster, (2, 4)), cluster.device), None,
                     share_blocks=share)
    sol = solve(form.problem)
    return sol.objective, sol.num_variables


@pytest.mark.parametrize("name", list(SMALL))
def test_shared_blocks_reach_the_unshared_optimum_with_fewer_variables(name: str) -> None:
    spec, slack = SMALL[name]
    free, free_vars = _solve(spec, share=False)
    shared, shared_vars = _solve(spec, share=True)
    assert free <= shared * (1 + 1e-9)  # sharing only restricts
    assert shared <= free * (1 + slack + 1e-9)
    assert shared_vars < free_vars


def test_a_transformer_layer_is_found_from_structure() -> None:
    w = build_workload("gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=2")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    groups = repeated_blocks(graph)
    repeats = {len(g) for g in groups}
    assert 3 in repeats  # six layers: three pairs of layers
    # Each group ties the same op of every repeat: same op, same shape.
    for g in groups:
        nodes = [graph.nodes[i] for i in g]
        assert len({(n.op, n.out.shape) for n in nodes}) == 1


LLAMA = "hf:llama-3-8b,batch=2,seq=16,layers=4,hidden=64,heads=4,kv=2,ffn=128,vocab=128"


def _covered_matmuls(graph) -> tuple[int, int]:
    covered = {i for g in repeated_blocks(graph) for i in g}
    mms = [i for i, n in enumerate(graph.nodes) if n.op == "mm"]
    return sum(i in covered for i in mms), len(mms)


def test_blocks_that_read_one_mask_and_rotary_table_repeat(monkeypatch) -> None:
    """A Llama computes its attention mask and rotary tables once and every block reads them,
    each from further back: named by themselves, not by their distance, the blocks repeat
    (every block after the first, whose residual input is the embedding's, read across the
    mask's ops); named by distance, most of them did not."""
    import meshplan.planner.intra.blocks as blocks
    w = build_workload(LLAMA, device="meta")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    shared, total = _covered_matmuls(graph)
    assert (shared, total) == (7 * 3, 7 * 4 + 1)   # 7 per block, the LM head's alone
    monkeypatch.setattr(blocks, "HUB_READERS", 10**9)
    assert _covered_matmuls(graph)[0] < shared


def test_doubling_runs_let_any_number_of_repeats_take_another_plan() -> None:
    """`api._refine` loosens the block ties into runs of 1, 2, 4, ... consecutive repeats and
    a free last repeat: few decisions, and yet any number of a block's repeats can take
    another plan (a budget mixing lean and fast blocks), each run tied to its own first."""
    from itertools import combinations

    from meshplan.planner.intra.formulate import doubling_runs
    for repeats in range(2, 40):
        others = tuple(range(1, repeats))
        loose = doubling_runs(tuple((0, v) for v in others) + tuple((100, 100 + v)
                                                                    for v in others))
        runs: dict[int, list[int]] = {}
        for first, other in loose:
            assert first < other and first not in {o for _, o in loose}
            runs.setdefault(first, [first]).append(other)
        tied = {v for run in runs.values() for v in run}
        runs.update({v: [v] for v in range(repeats) if v not in tied})   # untied: own runs
        runs.update({v: [v] for v in range(100, 100 + repeats) if v not in tied})
        mine = [run for first, run in runs.items() if first < 100]
        assert sorted(v for run in mine for v in run) == list(range(repeats))
        assert all(run == list(range(run[0], run[-1] + 1)) for run in mine)   # consecutive
        assert len(mine) <= repeats.bit_length() + 1 and [repeats - 1] in mine
        sums = {sum(len(r) for r in chosen) for k in range(len(mine) + 1)
                for chosen in combinations(mine, k)}
        assert sums == set(range(repeats + 1)), repeats
