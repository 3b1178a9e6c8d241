"""Repeated blocks: find a program's repeated layers so their ops share ILP decisions.

Recognized from the graph's structure alone (no module names). Every op gets a key of its own
(op, output shape and dtype, signature, parameter operands by shape) and, per computed
operand, its distance back (a value computed in the same block) and, for a value read by at
least `HUB_READERS` ops, the value itself (computed once and read by every block: a Llama's
attention mask and rotary tables, which each block reads from further back). Ops ``i`` and
``i + P`` match when their keys are equal and each operand is named alike one way or the
other. (Reading one value is not enough to match: q, k and v read one normalized input, and
tying k to v inside a layer is not a repeated block.) A block is the period ``P`` whose
matches run longest; the run holds the repeats ``start + r·P``. Alternating patterns inside a
block (column- then row-parallel) survive, because the whole block, not each op, is the unit
that repeats; with four or more repeats two consecutive blocks form the unit, so a pattern
alternating from layer to layer survives too. Sharing is exact when the blocks' optimal
strategies agree, which tests check against the unshared optimum.
"""

from __future__ import annotations

import numpy as np

from meshplan.ir.graph import Graph

# Operands matched either way (distance or producer); an op's further operands are matched by
# distance only, inside its own key (a concatenation of many values).
_SLOTS = 4
# A value read by this many ops or more may be named by itself (a hub every block reads).
HUB_READERS = 4


def _keys(graph: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(own, near, far): each op's own key; per operand slot its producer's distance back and
    its index if it is a hub, else a number no other op has (-1 where the op has fewer
    computed operands)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    readers = graph.users
    n_ops = len(graph.nodes)
    own = np.empty(n_ops, dtype=np.int64)
    near = np.full((n_ops, _SLOTS), -1, dtype=np.int64)
    far = np.full((n_ops, _SLOTS), -1, dtype=np.int64)
    for i, n in enumerate(graph.nodes):
        operands, slot = [], 0
        for name in n.inputs:
            src = graph.by_name[name]
            if src.is_source:
                operands.append(("param", src.out.shape))
            elif slot < _SLOTS:
                hub = len(readers[name]) >= HUB_READERS
                near[i, slot] = i - index[name]
                far[i, slot] = index[name] if hub else -2 - i * _SLOTS - slot
                operands.append("slot")
                slot += 1
            else:
                operands.append(i - index[name])
        sig = (n.sig.inputs, n.sig.output, n.sig.kind) if n.sig is not None else None
        own[i] = hash((n.role, n.op, n.out.shape, n.out.dtype, tuple(operands), sig))
    return own, near, far


def _matches(own: np.ndarray, near: np.ndarray, far: np.ndarray, period: int) -> np.ndarray:
    """``out[i]``: op ``i`` matches op ``i + period``."""
    eq = own[:-period] == own[period:]
    for k in range(near.shape[1]):
        eq &= (near[:-period, k] == near[period:, k]) | (far[:-period, k] == far[period:, k])
    return eq


def _longest_run(eq: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True."""
    if not eq.any():
        return 0, 0
    padded = np.concatenate([[False], eq, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _best_period(own: np.ndarray, near: np.ndarray, far: np.ndarray, min_block: int
                 ) -> tuple[int, int, int]:
    """(covered, period, start) of the repetition covering the most ops."""
    best = (0, 0, 0)
    for period in range(min_block, len(own) // 2 + 1):
        start, length = _longest_run(_matches(own, near, far, period))
        covered = (length // period) * period
        if covered > best[0]:
            best = (covered, period, start)
    return best


def repeated_blocks(graph: Graph, min_block: int = 4, max_kinds: int = 8
                    ) -> tuple[tuple[int, ...], ...]:
    """Groups of node indices that must share decisions: each group holds the same op of every
    repeat of a block. Several kinds of block are found (a ResNet's stages), the largest first;
    empty when nothing repeats at least twice. Remembered per graph: the stage search
    formulates one layer's program on every submesh and logical mesh, and its blocks are the
    program's, whatever the mesh."""
    memo = graph.__dict__.setdefault("_repeated_blocks", {})   # beside its cached properties
    key = (min_block, max_kinds, HUB_READERS)
    if key not in memo:
        memo[key] = _find_blocks(graph, min_block, max_kinds)
    return memo[key]


def _find_blocks(graph: Graph, min_block: int, max_kinds: int) -> tuple[tuple[int, ...], ...]:
    own, near, far = _keys(graph)
    groups: list[tuple[int, ...]] = []
    fresh = -1
    for _ in range(max_kinds):
        covered, period, start = _best_period(own, near, far, min_block)
        if not covered:
            break
        repeats = covered // period + 1
        if repeats >= 4:  # pairs of layers: a pattern alternating layer by layer survives
            period, repeats = 2 * period, repeats // 2
        groups += [tuple(start + k + r * period for r in range(repeats))
                   for k in range(period)]
        span = np.arange(start, start + repeats * period)
        own[span] = np.arange(fresh, fresh - len(span), -1)  # taken: never matches again
        fresh -= len(span)
    return tuple(groups)
