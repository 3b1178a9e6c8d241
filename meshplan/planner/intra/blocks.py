"""Repeated blocks: find a program's repeated layers so their ops share ILP decisions.

Recognized from the graph's structure alone (no module names): every op gets a key made of its
op, output shape and dtype, signature, and where its operands come from — an operand computed
in the same block is named by its distance back, a parameter by its shape. A block is the
period ``P`` for which ``key[i] == key[i + P]`` holds over the longest run; the run holds the
repeats ``start + r·P``. Alternating patterns inside a block (column- then row-parallel) survive,
because the whole block, not each op, is the unit that repeats; with four or more repeats two
consecutive blocks form the unit, so a pattern alternating from layer to layer survives too. Sharing is exact when the
blocks' optimal strategies agree, which tests check against the unshared optimum.
"""

from __future__ import annotations

import numpy as np

from meshplan.ir.graph import Graph


def _keys(graph: Graph) -> list[int]:
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    keys = []
    for i, n in enumerate(graph.nodes):
        operands = []
        for name in n.inputs:
            src = graph.by_name[name]
            operands.append(("param", src.out.shape) if src.is_source else i - index[name])
        sig = (n.sig.inputs, n.sig.output, n.sig.kind) if n.sig is not None else None
        keys.append(hash((n.role, n.op, n.out.shape, n.out.dtype, tuple(operands), sig)))
    return keys


def _longest_run(eq: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True."""
    if not eq.any():
        return 0, 0
    padded = np.concatenate([[False], eq, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _best_period(keys: np.ndarray, min_block: int) -> tuple[int, int, int]:
    """(covered, period, start) of the repetition covering the most ops."""
    best = (0, 0, 0)
    for period in range(min_block, len(keys) // 2 + 1):
        start, length = _longest_run(keys[:-period] == keys[period:])
        covered = (length // period) * period
        if covered > best[0]:
            best = (covered, period, start)
    return best


def repeated_blocks(graph: Graph, min_block: int = 4, max_kinds: int = 8) -> list[list[int]]:
    """Groups of node indices that must share decisions: each group holds the same op of every
    repeat of a block. Several kinds of block are found (a ResNet's stages), the largest first;
    empty when nothing repeats at least twice."""
    keys = np.array(_keys(graph), dtype=np.int64)
    groups: list[list[int]] = []
    fresh = -1
    for _ in range(max_kinds):
        covered, period, start = _best_period(keys, min_block)
        if not covered:
            break
        repeats = covered // period + 1
        if repeats >= 4:  # pairs of layers: a pattern alternating layer by layer survives
            period, repeats = 2 * period, repeats // 2
        groups += [[start + k + r * period for r in range(repeats)] for k in range(period)]
        span = np.arange(start, start + repeats * period)
        keys[span] = np.arange(fresh, fresh - len(span), -1)  # taken: never matches again
        fresh -= len(span)
    return groups
