"""Layers priced in parts: an end layer that holds a repeated layer plus something else.

The layering's first layer usually holds the embedding (and on Llama the rotary tables and
the mask) with the first block, and the last may hold a block with the head. Such a layer's
structure occurs once, so the stage pricing solves it on every submesh and logical shape as a
problem of its own, the largest of all (GPT-39B: 33 of a micro-batch count's 56 s of
one-layer solves, Llama-3-70B 35 of 64). Priced as two parts, the part that is the
repeated layer shares that layer's solves, and the rest is a small problem.

A part equals the repeated layer when its program does, proved by `structure_key`, not
assumed: the layer's ops are matched to the repeated layer's by signature (op, shapes), from
the end of the layer (the block after the embedding) or from its start (the block before the
head), skipping ops that do not match. A skipped op joins the other part, which is allowed when
no op of the first part reads one of the second. This matters because the first block is
seldom the others' twin op for op: the capture's merging of common subexpressions leaves in it
the values every block computes alike (Llama's rotary tables unsqueezed, the mask's alias),
which the later blocks receive. The part's received inputs are then put in the order the
repeated layer's are (their first reader's position), and its structure key must equal the
repeated layer's. Where no part proves equal the layer is priced whole, as before.

A layer of two parts is priced as the sum of its parts, as a range of several layers is
(`stage_costs.StageProfiler._slot_columns`): what the second part receives from the first is
kept with its activations, and a recomputed layer keeps what the first part receives. Stages
the DP picks are solved whole, as ever.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

from meshplan.ir.graph import Graph, Node
from meshplan.planner.inter.clustering import Layering, layering_of
from meshplan.planner.inter.stage_graph import cut_stage, structure_key


@dataclass(frozen=True)
class LayerParts:
    """A refinement of a layering for pricing: layer ``m`` is the parts ``spans[m][0]`` to
    ``spans[m][1] - 1`` of ``parts``; ``programs[(p, p + 1)]`` is part p's program where it is
    not what `stage_graph` cuts (a part aligned with the repeated layer it equals)."""

    parts: Layering
    spans: tuple[tuple[int, int], ...]
    programs: Mapping[tuple[int, int], Graph]


def split_layers(graph: Graph, layering: Layering, keys: list[str],
                 stage: Callable[[int], Graph]) -> LayerParts | None:
    """The layers of ``layering`` whose structure occurs once split where a part proves equal
    to a repeated layer (module docstring), or None when none is. ``keys[m]`` is layer m's
    `structure_key`, ``stage(m)`` its program."""
    counts = Counter(keys)
    repeated = {}   # key -> its first layer, the commonest first
    for m in sorted(range(len(keys)), key=lambda m: -counts[keys[m]]):
        if counts[keys[m]] > 1:
            repeated.setdefault(keys[m], m)
    if not repeated:
        return None
    op_names = [[x for x in names if graph.by_name[x].role == "op"] for names in layering.layers]
    splits: dict[int, tuple[list[str], list[str], Graph, bool]] = {}
    for m, k in enumerate(keys):
        if counts[k] > 1:
            continue
        for key, r in repeated.items():
            found = _part_like(graph, layering, m, op_names[m], op_names[r], stage(r), key)
            if found is not None:
                splits[m] = found
                break
    if not splits:
        return None
    op_part: dict[str, int] = {}
    spans, programs = [], {}
    for m, names in enumerate(op_names):
        first = len(spans) and spans[-1][1]
        if m not in splits:
            op_part.update((x, first) for x in names)
            spans.append((first, first + 1))
            continue
        before, after, program, part_is_after = splits[m]
        op_part.update((x, first) for x in before)
        op_part.update((x, first + 1) for x in after)
        programs[(first + 1, first + 2) if part_is_after else (first, first + 1)] = program
        spans.append((first, first + 2))
    parts = layering_of(graph, op_part, spans[-1][1], layering.delta, layering.requested_delta)
    return LayerParts(parts, tuple(spans), programs)


def _part_like(graph: Graph, layering: Layering, m: int, ops: list[str], like_ops: list[str],
               like: Graph, like_key: str) -> tuple[list[str], list[str], Graph, bool] | None:
    """Layer ``m`` (ops ``ops``) as (first part's ops, second part's ops, the program of the
    part equal to ``like``, whether that part is the second), or None when neither a part at
    its end nor one at its start proves equal to ``like`` (ops ``like_ops``, structure key
    ``like_key``)."""
    if len(ops) <= len(like_ops):
        return None
    sig = {x: _op_signature(graph, graph.by_name[x]) for x in (*ops, *like_ops)}
    for at_end in (True, False):
        order = ops[::-1] if at_end else ops
        target = like_ops[::-1] if at_end else like_ops
        matched, j = [], 0
        for x in order:
            if j < len(target) and sig[x] == sig[target[j]]:
                matched.append(x)
                j += 1
        if j < len(target):
            continue
        part = set(matched)
        rest = [x for x in ops if x not in part]
        first, second = (rest, [x for x in ops if x in part]) if at_end else \
            ([x for x in ops if x in part], rest)
        later = set(second)
        if any(i in later for x in first for i in graph.by_name[x].inputs):
            continue   # the first part would read the second
        where = dict(layering.layer_of)
        where.update((x, 2 * m) for x in first)
        where.update((x, 2 * m + 1) for x in second)
        for name, j in layering.layer_of.items():
            if j != m:
                where[name] = 2 * j + (1 if j > m else 0)
        cut = cut_stage(graph, where, 2 * m + 1, 2 * m + 2) if at_end else \
            cut_stage(graph, where, 2 * m, 2 * m + 1)
        aligned = _aligned(cut, like)
        if aligned is not None and structure_key(aligned) == like_key:
            return first, second, aligned, at_end
    return None


def _op_signature(graph: Graph, n: Node) -> tuple:
    return (n.op, n.out.shape, n.out.dtype, tuple(graph.by_name[x].out.shape for x in n.inputs))


def _aligned(part: Graph, like: Graph) -> Graph | None:
    """``part``'s nodes in ``like``'s order: op for op, and each other node (parameter, received
    value) where ``like`` has the one its first reader reads at the same position; None when
    the two do not correspond so."""
    part_ops = [n for n in part.nodes if n.role == "op"]
    like_ops = [n for n in like.nodes if n.role == "op"]
    if len(part_ops) != len(like_ops) or len(part.nodes) != len(like.nodes):
        return None
    part_by_read = _by_first_read(part, part_ops)
    like_by_read = {name: at for at, name in _by_first_read(like, like_ops).items()}
    op_at = {n.name: i for i, n in enumerate(like_ops)}
    nodes = []
    for n in like.nodes:
        if n.role == "op":
            nodes.append(part_ops[op_at[n.name]])
            continue
        at = like_by_read.get(n.name)
        if at is None or at not in part_by_read:
            return None
        nodes.append(part.by_name[part_by_read[at]])
    if len({n.name for n in nodes}) != len(nodes):
        return None
    return Graph(tuple(nodes), part.loss, part.unsupported_ops)


def _by_first_read(g: Graph, ops: list[Node]) -> dict[tuple[int, int], str]:
    """(op index, operand position) of each non-op node's first read -> its name."""
    out: dict[tuple[int, int], str] = {}
    seen: set[str] = set()
    for i, n in enumerate(ops):
        for a, x in enumerate(n.inputs):
            if x not in seen and g.by_name[x].role != "op":
                seen.add(x)
                out[(i, a)] = x
    return out
