"""Operator clustering (Alpa eq. 6): hand-made optimum, brute force, GPT structure, speed."""

from __future__ import annotations

import itertools
import random
import re
import time
from dataclasses import replace

import numpy as np
import pytest

from meshplan.capture.to_ir import capture
from meshplan.ir.graph import Graph, Node, TensorInfo
from meshplan.planner.inter import clustering
from meshplan.planner.inter.clustering import (
    DEFAULT_DELTA, MIN_RELAXED_DELTA, Layering, cluster_layers, default_num_layers,
    repeated_unit,
)
from meshplan.planner.inter.layer_signature import layer_signature
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers={layers},heads=4,seq=16,vocab=128,batch=8"


def _source(name: str, role: str, numel: int = 4) -> Node:
    return Node(name, role, role, (), TensorInfo((numel,), "float32"), None)


def _op(name: str, inputs: tuple[str, ...], nbytes: int, flops: float) -> Node:
    return Node(name, "op", "f", inputs, TensorInfo((nbytes,), "uint8"), None, flops=flops)


def _toy() -> Graph:
    """o1 (400 B) is read by o2 and o3; cutting after o3 is cheapest (8 B) but its first layer
    holds 30 of 35 FLOPs; w is read by o1 and o4 (tied)."""
    nodes = (_source("x", "input"), _source("w", "param"), _source("t", "target"),
             _op("o1", ("x", "w"), 400, 10), _op("o2", ("o1",), 40, 10),
             _op("o3", ("o1", "o2", "x"), 8, 10), _op("o4", ("o3", "w", "t"), 4, 5))
    return Graph(nodes, "o4")


def test_toy_optimum_under_the_flop_bound() -> None:
    # δ = 0.5: at most 26.25 FLOPs a layer, so the cut after o3 is out; o1 counts once (400).
    lay = cluster_layers(_toy(), 2, delta=0.5)
    assert lay.layers == (("x", "w", "o1"), ("t", "o2", "o3", "o4"))  # t: first read by o4
    assert lay.inbound_bytes == (0, 400) and lay.objective == 400
    assert lay.flops == (10.0, 25.0) and lay.delta == 0.5
    # δ = 1: 35 FLOPs allowed, the 8-byte cut wins.
    lay = cluster_layers(_toy(), 2, delta=1.0)
    assert lay.layers == (("x", "w", "o1", "o2", "o3"), ("t", "o4"))
    assert lay.objective == 8 and lay.layer_index("w") == 0 and lay.layer_index("o4") == 1


def test_fewest_bytes_before_balance() -> None:
    # Six equal ops; every cut but the one after o2 sends 100 B, so two cuts cost at least
    # 100 (the objective). Perfect balance (cuts after o1 and o3) sends 200 B in all; a cut
    # after o2 and another sends 110, what a recomputed stage keeps: fewer bytes win.
    nodes = [_source("x", "input")]
    for k, nbytes in enumerate((100, 100, 10, 100, 100, 100)):
        nodes.append(_op(f"o{k}", (nodes[-1].name,), nbytes, 10.0))
    lay = cluster_layers(Graph(tuple(nodes), "o5"), 3, delta=0.5)
    assert lay.objective == 100 and sum(lay.inbound_bytes) == 110
    assert 10 in lay.inbound_bytes and max(lay.flops) <= 30


def test_zero_flops_balance_by_op_count() -> None:
    nodes = [_source("x", "input")]
    for k in range(6):
        nodes.append(_op(f"o{k}", (nodes[-1].name,), 4, 0.0))
    lay = cluster_layers(Graph(tuple(nodes), "o5"), 3, delta=0.0)
    assert [len([n for n in names if n != "x"]) for names in lay.layers] == [2, 2, 2]
    assert lay.objective == 4


def test_delta_relaxed_until_feasible() -> None:
    nodes = [_source("x", "input")]
    for k, flops in enumerate((100, 1, 1, 1)):
        nodes.append(_op(f"o{k}", (nodes[-1].name,), 4, flops))
    graph = Graph(tuple(nodes), "o3")
    lay = cluster_layers(graph, 2, delta=0.1)  # 0.1 → 0.2 → 0.4 → 0.8 → 1.6 fits 100 of 103
    assert lay.requested_delta == 0.1 and lay.delta == pytest.approx(1.6)
    # From δ = 0: 0.125, 0.25, …, 4 (a limit of 5 · 103 / 4 ≥ 100), even at L = K.
    assert cluster_layers(graph, 4, delta=0.0).delta == pytest.approx(4.0)


@pytest.mark.parametrize("bad", [0, 5, -1, 2.0, True])
def test_invalid_num_layers(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape("[1, 4]")):
        cluster_layers(_toy(), bad)  # type: ignore[arg-type]


def test_invalid_delta_and_devices() -> None:
    with pytest.raises(ValueError, match="delta=-0.1"):
        cluster_layers(_toy(), 2, delta=-0.1)
    with pytest.raises(ValueError, match="num_devices=0"):
        default_num_layers(_toy(), 0)


# ---- brute force on random small graphs --------------------------------------------------

def _random_graph(rng: random.Random, num_ops: int) -> Graph:
    nodes = [_source("x", "input"), _source("w", "param"), _source("y", "target")]
    zero = rng.random() < 0.15
    for k in range(num_ops):
        reads = rng.sample([n.name for n in nodes], min(len(nodes), rng.randint(1, 3)))
        flops = 0 if zero else rng.choice([0, 1, 2, 5, 5, 8, 20])
        nodes.append(_op(f"o{k}", tuple(reads), rng.choice([1, 2, 2, 4, 8]), flops))
    return Graph(tuple(nodes), nodes[-1].name)


def _splits(graph: Graph, num_layers: int, delta: float) -> list[tuple[int, int, float]]:
    """(max C, Σ C, Σ weight²) of every split meeting the FLOP bound, by the definition."""
    return [f for f, _ in _splits_with_bounds(graph, num_layers, (1 + delta) / num_layers)]


def _splits_with_bounds(graph: Graph, num_layers: int, limit: float
                        ) -> list[tuple[tuple[int, int, float], tuple[int, ...]]]:
    """`_splits` with each split's layer starts: at most ``limit`` of the weight per layer."""
    ops = [n for n in graph.nodes if n.role == "op"]
    weight = [n.flops for n in ops] if sum(n.flops for n in ops) > 0 else [1.0] * len(ops)
    limit = limit * sum(weight) + 1e-9 * sum(weight)
    out = []
    for cuts in itertools.combinations(range(1, len(ops)), num_layers - 1):
        bounds = (0, *cuts, len(ops))
        spans = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        if any(sum(weight[k] for k in s) > limit for s in spans):
            continue
        produced_before = [{o.name for o in ops[:s.start]} for s in spans]
        inbound = [sum(graph.by_name[x].out.nbytes for x in
                       {x for k in s for x in ops[k].inputs} & before)
                   for s, before in zip(spans, produced_before)]
        out.append(((max(inbound), sum(inbound),
                     sum(sum(weight[k] for k in s) ** 2 for s in spans)), bounds[:-1]))
    return out


def _layer_weights(graph: Graph, lay: Layering) -> list[float]:
    ops = [n for n in graph.nodes if n.role == "op"]
    if sum(n.flops for n in ops) > 0:
        return list(lay.flops)
    return [float(sum(graph.by_name[x].role == "op" for x in names)) for names in lay.layers]


def test_matches_brute_force_on_random_graphs() -> None:
    rng = random.Random(0)
    for _ in range(300):
        num_ops = rng.randint(1, 10)
        graph = _random_graph(rng, num_ops)
        num_layers = rng.randint(1, min(4, num_ops))
        delta = rng.choice([0.0, 0.1, 0.5, 1.0])
        lay = cluster_layers(graph, num_layers, delta=delta)
        step = delta
        while step < lay.delta:  # every smaller δ of the doubling sequence was infeasible
            assert not _splits(graph, num_layers, step)
            step = max(2 * step, MIN_RELAXED_DELTA)
        assert step == lay.delta
        found = _splits(graph, num_layers, lay.delta)
        best = min(c for c, _, _ in found)
        fewest = min(total for c, total, _ in found if c == best)
        least = min(sq for c, total, sq in found if c == best and total == fewest)
        assert lay.objective == best and sum(lay.inbound_bytes) == fewest
        assert sum(w * w for w in _layer_weights(graph, lay)) == pytest.approx(least)
        names = [name for layer in lay.layers for name in layer]
        assert sorted(names) == sorted(n.name for n in graph.nodes)


def test_cuts_restricted_match_brute_force_on_random_graphs() -> None:
    # Layers allowed to start only where a mask says (one phase of a repeated unit): the
    # fewest layers needed, G and the tie-breaks agree with enumerating the allowed splits.
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        num_ops = rng.randint(2, 10)
        graph = _random_graph(rng, num_ops)
        num_layers = rng.randint(1, min(4, num_ops))
        cuts = np.array([True] + [rng.random() < 0.5 for _ in range(num_ops - 1)] + [True])
        ops = clustering._op_table(graph)
        prefix = np.concatenate([[0.0], np.cumsum(ops.weight)])
        delta = rng.choice([0.1, 0.5, 1.0])
        starts = clustering._window_starts(prefix, (1 + delta) / num_layers + 1e-9)
        if clustering._num_parts_needed(starts) is None:
            continue   # an op alone over the bound: δ would be relaxed first
        limit = (1 + delta) / num_layers
        found = [f for f, bounds in _splits_with_bounds(graph, num_layers, limit)
                 if all(cuts[b] for b in bounds)]
        fewest = clustering._num_parts_needed(starts, cuts)
        fits = [k for k in range(1, num_ops + 1)
                if any(all(cuts[b] for b in bounds)
                       for _, bounds in _splits_with_bounds(graph, k, limit))]
        assert fewest == (min(fits) if fits else None)
        best = clustering._min_max_inbound(ops, starts, num_layers, cuts)
        if not found:
            assert best == np.inf
            continue
        checked += 1
        assert best == min(c for c, _, _ in found)
        split, (total, square) = clustering._least_square_split(ops, starts, prefix, num_layers,
                                                                best, cuts)
        assert all(cuts[b] for b in split)
        fewest_bytes = min(t for c, t, _ in found if c == best)
        assert total == fewest_bytes
        total_weight = sum(n.flops for n in graph.nodes if n.role == "op") or \
            sum(n.role == "op" for n in graph.nodes)
        assert square * total_weight ** 2 == pytest.approx(
            min(sq for c, t, sq in found if c == best and t == fewest_bytes))
        # Least Σ FLOP² first (a split at a transformer's phase), then least Σ C.
        split, (total, square) = clustering._least_square_split(
            ops, starts, prefix, num_layers, best, cuts, flops_first=True)
        assert all(cuts[b] for b in split)
        least_square = min(sq for c, _, sq in found if c == best)
        assert square * total_weight ** 2 == pytest.approx(least_square)
        assert total == min(t for c, t, sq in found if c == best
                            and sq == pytest.approx(least_square))
    assert checked > 100


# ---- GPTs: a captured 8-block one, and 96 blocks tiled from a captured 2-block one ----------

def _capture(spec: str) -> Graph:
    w = build_workload(spec, device="meta")
    return capture(w.model, w.loss_fn, w.example_batch)[1]


def _tile_blocks(graph: Graph, num_blocks: int) -> Graph:
    """A captured GPT with block 1 repeated until there are ``num_blocks`` blocks: op for op the
    graph a ``layers=num_blocks`` capture gives (checked when written), but capturing 96 blocks
    takes 10-20 s here, this a fraction of a second. Copies rename nodes and state names."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}

    def first_reader(state_name: str) -> int:
        (p,) = [n for n in graph.params() if n.state_name == state_name]
        return min(index[u] for u in graph.users[p.name])

    start, end = first_reader("blocks.1.ln_1.weight"), first_reader("ln_f.weight")
    block = graph.nodes[start:end]
    inside = {n.name for n in block}
    (carry_in,) = {x for n in block for x in n.inputs
                   if x not in inside and graph.by_name[x].role == "op"}
    params = [p for p in graph.params() if (p.state_name or "").startswith("blocks.1.")]
    nodes, last = list(graph.nodes[:end]), block[-1].name
    for j in range(2, num_blocks):
        rename = {n.name: f"{n.name}_b{j}" for n in (*params, *block)}
        rename[carry_in] = last
        nodes += [replace(n, name=rename[n.name], inputs=tuple(rename.get(x, x) for x in n.inputs),
                          state_name=n.state_name and
                          n.state_name.replace("blocks.1.", f"blocks.{j}."))
                  for n in (*params, *block)]
        last = rename[block[-1].name]
    tail = [replace(n, inputs=tuple(last if x == block[-1].name else x for x in n.inputs))
            for n in graph.nodes[end:]]
    return Graph(tuple(nodes + tail), graph.loss)


@pytest.fixture(scope="module")
def gpt8() -> Graph:
    return _capture(GPT.format(layers=8))


@pytest.fixture(scope="module")
def gpt96() -> Graph:
    return _tile_blocks(_capture(GPT.format(layers=2)), 96)


def _num_blocks(graph: Graph) -> int:
    return sum(p.state_name.endswith("ln_1.weight") for p in graph.params())


def _block_of_matmuls(graph: Graph, prefix: str = r"blocks\.") -> dict[str, int]:
    """mm node -> transformer block, through its transposed ``<prefix><j>.`` weight."""
    out = {}
    for p in graph.params():
        m = re.match(prefix + r"(\d+)\.", p.state_name or "")
        for t in graph.users[p.name] if m else ():
            for u in graph.users[t]:
                if graph.by_name[u].op == "mm":
                    out[u] = int(m.group(1))
    return out


def test_speed_96_blocks(gpt96: Graph) -> None:
    assert _num_blocks(gpt96) == 96 and sum(n.role == "op" for n in gpt96.nodes) > 4000
    for num_layers in (96, 24):
        start = time.perf_counter()
        lay = cluster_layers(gpt96, num_layers)
        elapsed = time.perf_counter() - start
        print(f"cluster_layers(GPT with 96 blocks, L={num_layers}): {elapsed:.2f} s")
        assert elapsed < 30 and lay.num_layers == num_layers


@pytest.mark.parametrize("name", ["gpt8", "gpt96"])
def test_gpt_blocks_one_per_layer(name: str, request: pytest.FixtureRequest) -> None:
    graph: Graph = request.getfixturevalue(name)
    num_blocks = _num_blocks(graph)
    lay = cluster_layers(graph, num_blocks)
    blocks = _block_of_matmuls(graph)
    assert len(blocks) == 6 * num_blocks
    layer_of_block: dict[int, int] = {}
    for mm, block in blocks.items():
        assert layer_of_block.setdefault(block, lay.layer_index(mm)) == lay.layer_index(mm)
    assert [layer_of_block[b] for b in range(num_blocks)] == list(range(num_blocks))
    assert lay.delta == DEFAULT_DELTA
    assert max(lay.flops) <= (1 + lay.delta) * sum(lay.flops) / num_blocks
    residual = 8 * 16 * 64 * 4  # one (batch, seq, hidden) float32 tensor crosses each cut
    assert lay.objective == residual and lay.inbound_bytes[0] == 0


@pytest.mark.parametrize("name", ["gpt8", "gpt96"])
def test_sources_join_their_first_consumer(name: str, request: pytest.FixtureRequest) -> None:
    graph: Graph = request.getfixturevalue(name)
    lay = cluster_layers(graph, _num_blocks(graph))
    for n in graph.nodes:
        if n.is_source:
            assert lay.layer_index(n.name) == min(lay.layer_index(u) for u in graph.users[n.name])
    (wte,) = (p for p in graph.params() if p.state_name == "wte.weight")  # tied with the head
    assert lay.layer_index(wte.name) == 0
    assert max(lay.layer_index(u) for u in graph.users[wte.name]) == lay.num_layers - 1


@pytest.mark.parametrize("name", ["gpt8", "gpt96"])
def test_middle_layers_share_a_signature(name: str, request: pytest.FixtureRequest) -> None:
    graph: Graph = request.getfixturevalue(name)
    lay = cluster_layers(graph, _num_blocks(graph))
    sigs = [layer_signature(graph, lay, j) for j in range(lay.num_layers)]
    assert len(set(sigs[1:-1])) == 1
    assert sigs[0] != sigs[1] and sigs[-1] != sigs[1]
    with pytest.raises(ValueError, match=f"index={lay.num_layers}"):
        layer_signature(graph, lay, lay.num_layers)


def test_default_num_layers(gpt8: Graph, gpt96: Graph) -> None:
    # min(2 · devices, heavy ops // 3), snapped to a divisor of the number of blocks.
    assert [default_num_layers(gpt8, d) for d in (1, 2, 3, 4, 1000)] == [2, 4, 4, 8, 8]
    assert default_num_layers(gpt96, 1) == 2
    assert default_num_layers(gpt96, 8) == 16
    assert default_num_layers(gpt96, 20) == 32  # target 40 → 32 divides 96
    assert default_num_layers(gpt96, 64) == 96
    assert default_num_layers(gpt96, 10_000) == 96


def test_default_num_layers_sees_blocks_past_a_look_alike_head() -> None:
    # vocab = 4 · hidden: the LM head has the MLP up-projection's shape (5 of that kind, not 4).
    graph = _capture("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=256,batch=8")
    assert default_num_layers(graph, 2) == 4
    assert default_num_layers(graph, 1) == 2
    num_ops = sum(n.role == "op" for n in graph.nodes)
    assert all(1 <= default_num_layers(graph, d) <= num_ops for d in range(1, 65))


def test_repeated_unit_is_a_block(gpt8: Graph) -> None:
    rep = repeated_unit(gpt8)
    assert rep is not None
    ops = [n for n in gpt8.nodes if n.role == "op"]
    blocks = _block_of_matmuls(gpt8)
    # The period is one block's ops; the LM head (tied, vocab 128) is not a ninth block.
    assert rep.copies == 8
    first_mm = {b: min(k for k, n in enumerate(ops) if blocks.get(n.name) == b) for b in range(8)}
    assert {first_mm[b + 1] - first_mm[b] for b in range(7)} == {rep.period}
    assert rep.units >= 7


# A Llama whose LM head weighs more than a block (Llama 3's vocab against its hidden size),
# as many layers asked for as blocks.
HEAVY_HEAD_LLAMA = ("hf:llama-3-8b,batch=2,seq=16,layers=6,hidden=64,heads=4,kv=2,ffn=224,"
                    "vocab=1024")


def test_layers_hold_whole_blocks_past_a_heavy_head() -> None:
    graph = _capture(HEAVY_HEAD_LLAMA)
    # One layer more than the blocks: the head too heavy to share a layer with a block.
    assert default_num_layers(graph, 64) == 7
    lay = cluster_layers(graph, 7)
    sigs = [layer_signature(graph, lay, j) for j in range(lay.num_layers)]
    assert len(set(sigs[1:-1])) == 1 and len(set(sigs)) == 3
    # Every layer's attention with its MLP: the middle layers are the blocks 1..5.
    blocks = _block_of_matmuls(graph, r"model\.layers\.")
    for j in range(1, 6):
        assert {blocks[x] for x in lay.layers[j] if x in blocks} == {j}
    # The cuts at one phase of the block cost nothing in eq. 6's objective: the unrestricted
    # split reaches the same largest inbound bytes, with layers of several kinds.
    free = _without_uniform(lambda: cluster_layers(graph, 7))
    assert free.objective == lay.objective
    assert len({layer_signature(graph, free, j) for j in range(7)}) > 3


def _without_uniform(run):
    saved = clustering._uniform_split
    clustering._uniform_split = lambda *a, **k: None
    try:
        return run()
    finally:
        clustering._uniform_split = saved


@pytest.mark.parametrize("spec", [
    "hf:qwen2.5-7b,batch=2,seq=64,layers=6,hidden=128,heads=4,kv=2,ffn=384,vocab=2048",
    # Gemma 2 makes its masks at their first use: its first two blocks differ in light ops.
    "hf:gemma-2-9b,batch=2,seq=64,layers=6,hidden=128,heads=4,kv=2,ffn=384,vocab=2048",
    HEAVY_HEAD_LLAMA])
def test_repeated_unit_counts_every_block(spec: str) -> None:
    rep = repeated_unit(_capture(spec))
    assert rep is not None and rep.copies == 6


@pytest.mark.parametrize("spec", [
    "hf:llama-3-8b,batch=2,seq=16,layers=12,hidden=64,heads=4,kv=2,ffn=224,vocab=256",
    "hf:gemma-2-9b,batch=2,seq=64,layers=12,hidden=128,heads=4,kv=2,ffn=384,vocab=2048",
    # The head heavier than two blocks: a layer of its own, the blocks 2 and 3 to a layer.
    "hf:llama-3-8b,batch=2,seq=16,layers=12,hidden=64,heads=4,kv=2,ffn=224,vocab=4096"])
def test_no_layer_is_spent_on_the_free_ops_before_the_blocks(spec: str) -> None:
    """Hugging Face models make their position ids, rotary tables and masks before the first
    block: a dozen ops of no FLOPs, each cut after sending almost nothing. Least bytes first
    spent layers there (Llama 3 8B on 8 devices: 4 of 16 layers of 1-5 ops, the blocks 3 to
    a layer where 2 would do; Gemma 2's, whose blocks alternate two masks, made one-block
    layers and packed the rest 5-6 to a layer). A split at one phase of the blocks starts
    its first layer at the first op of some weight and, the program being its blocks and a
    head, balances FLOPs before bytes (`_uniform_split`)."""
    graph = _capture(spec)
    lay = cluster_layers(graph, default_num_layers(graph, 3))
    assert lay.num_layers == 6
    mean = sum(lay.flops) / lay.num_layers
    assert min(lay.flops) >= 0.5 * mean, [f / mean for f in lay.flops]
