"""Operator clustering (Alpa §5, eq. 6): group the forward's ops into L contiguous layers.

The op nodes o_1..o_K (role ``"op"``, graph order, which is topological) are cut into L
contiguous layers. With ``C(i, k)`` the bytes that o_i..o_k receive from o_1..o_{i-1}, and
``FLOP(i, k)`` their forward FLOPs,

    G(k, r) = min_{i ≤ k} max(G(i-1, r-1), C(i, k))   s.t. FLOP(i, k) ≤ (1 + δ) · FLOP_total / L
    G(0, 0) = 0,   objective G(K, L).

Among the splits that reach ``G(K, L)``, the one receiving the fewest bytes in all is kept, and
among those the one with the smallest variance of per-layer FLOPs. Alpa breaks the tie by
variance alone, which lets every cut land anywhere under the bound: on a GPT whose LM head
weighs about a block (7.5B, L = 36 blocks) the cuts then drift through the blocks, most layers
receive an MLP's 4h-wide activation or an attention context next to the residual stream, and a
layer-by-layer recomputation keeping what each layer receives needs 126 GiB per device instead
of 18. The sum is what a recomputed stage keeps and what stage boundaries send; the variance's
mean is fixed (FLOP_total / L), so its tie-break is the smallest sum of squares. Both sums are
additive, so one DP over the pair, compared lexicographically, is exact; it is restricted to
layers with ``C(i, k) ≤ G(K, L)``:

    H(k, r) = lexmin_{i ≤ k, C(i, k) ≤ G(K, L)} H(i-1, r-1) + (C(i, k), FLOP(i, k)²)

(Carrying max, sum and Σ² through one DP would not be exact: a prefix with a larger max but
smaller sums can win once a later layer's C dominates the max.)

``C(i, k)`` counts each op output produced before o_i and read by some op of o_i..o_k once.
Sources are never communication: parameters, buffers and constants live on their stage, batch
inputs and the target are fed to any stage by data loading. Each source belongs to the layer
of its first consuming op (a tied embedding read by the first and last layers belongs to the
first; unused sources to layer 0).

Speed. FLOPs are nonnegative, so the allowed ``i`` for each ``k`` form a window
``[lo(k), k]``; for a value produced at ``p`` whose last reader up to ``k`` is ``q``, it counts
in C(i, k) exactly for ``p < i ≤ q``, so adding o_k adds its size to C(·, k) on
``(q_before, k]``. Both DPs sweep ``k`` once with numpy over (layers × window): the work is
about K² (1 + δ) cells whatever L is.

Whole units. A program that repeats a unit (a transformer's blocks: `repeated_unit` finds the
longest stretch of ops matching the ops one period later, the period taken from the distances
between heavy ops of one kind) is also split with layers starting only at one phase of the unit
inside that stretch and a unit either side of it (the phases whose cut sends the fewest bytes,
`_unit_cuts`): both DPs above, restricted to those starts. When such a split reaches the same
G(K, L) under the same FLOP bound it is kept, the one of fewest distinct layers first, then
fewest bytes and least Σ FLOP² (`_uniform_split`). Where the units and one op more (an LM
head) hold nearly all the FLOPs (`STRETCH_SHARE`: a transformer) least Σ FLOP² comes first.
Every cut at the phase sends the hidden state, but a layer of blocks of two kinds also
receives what each kind reads (Gemma 2 alternates sliding-window and global attention, each
with its mask): least Σ C made as many one-block layers as it could and packed the rest 6 to
a layer (Gemma 2 2B on 8 devices: 9 layers of 1 block, 3 of 5-6). Elsewhere (Wide-ResNet,
whose blocks of other widths are cut where they send very different bytes) least Σ C stays
first. The stage DP then sees equal layers, which
price once and balance into equal stages; the unrestricted tie-break could save a few bytes by
alternating layers (on Llama, attention-free layers do not receive the mask and the rotary
tables: attention+MLP+attention beside MLP alone, five kinds of layers instead of three).

The first layer. In such a split no layer starts before the program's first op of some
weight (a hundredth of a layer's mean FLOPs; or past half a layer's FLOPs, `_lead_cuts`):
what comes before it is no work for a stage of its own. Hugging Face models make position
ids, rotary tables and masks there, a dozen ops of no FLOPs, each cut after sending almost
nothing, so least Σ C spent layers on them: Llama 3 8B on 8 devices had 4 of its 16 layers
of 1-5 such ops, the blocks 3 to a layer where 2 would do (Gemma 2 9B on 16: 9 of 21
layers, the blocks 4 to one). The unrestricted split stays eq. 6's, exactly.

δ: `DEFAULT_DELTA` = 0.5, the default of Alpa's own implementation. A smaller δ forces cuts
away from the cheap points of a transformer: GPT-3 39B's LM head adds about half a block's
FLOPs to the last layer at L = number of blocks. When no split satisfies the bound, δ is doubled
(from at least `MIN_RELAXED_DELTA`) until one does; `Layering.delta` is the δ used. If
FLOP_total is 0, each op weighs 1, so layers are balanced by op count.

Alpa's "equal operator" ablation (§8.4, ``balance="ops"``) replaces both DPs by cuts at equal
op counts, blind to FLOPs and to what crosses a cut.

Choosing L (`default_num_layers`): Alpa picks "a small L from the number of devices and the
number of heavy ops". Here the target is ``min(2 · devices, heavy ops // 3)``: two layers per
device leave the stage DP room to balance, and Alpa keeps at least 3 heavy ops (matmul, conv,
attention) per layer. When the program repeats a unit n times (a GPT's n blocks), L snaps to
the largest divisor of n not above the target (n itself when the target is larger), so each
layer holds whole, equal units — unless that divisor is under half the target (n prime and
above the target), when the target stands. n is the repeated unit's count where there is one
(`Repeats.copies`), else `repeat_count`'s. When whole units per layer cannot meet the FLOP
bound (an LM head heavier than a block needs a layer of its own), one or two layers are added
(`MAX_EXTRA_LAYERS`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from meshplan.ir.graph import Graph

DEFAULT_DELTA = 0.5
MIN_RELAXED_DELTA = 0.125
HEAVY_OPS = frozenset({"mm", "bmm", "matmul", "conv", "sdpa"})
MIN_HEAVY_PER_LAYER = 3
BALANCES = ("flops", "ops")
LAYERS_PER_DEVICE = 2
# Layers `default_num_layers` may add so that layers hold whole repeated units.
MAX_EXTRA_LAYERS = 2
# The first layer reaches the first op weighing this share of a layer's mean FLOPs, or this
# much of a layer's FLOPs (`_lead_cuts`).
LEAD_SHARE = 0.01
LEAD_MOST = 0.5
# The share of the FLOPs in the repeated units and one op more from which a split at the
# unit's phase is balanced first (`_uniform_split`, `_blocks_and_a_head`): a transformer's
# blocks and LM head hold nearly all; Wide-ResNet's blocks of one width 0.29-0.66, its other
# blocks, whose cuts send very different bytes, the rest.
STRETCH_SHARE = 0.9
# Slack on the FLOP bound so rounding in prefix sums never excludes a split that meets it.
_REL_TOL = 1e-9


@dataclass(frozen=True)
class Layering:
    """Ops (and their sources) grouped into contiguous layers.

    ``layers[j]`` holds layer j's node names in graph order: its sources, then its ops.
    ``flops[j]`` is its forward FLOPs, ``inbound_bytes[j]`` the bytes of op outputs it reads from
    earlier layers (C of eq. 6). ``delta`` is the δ used (at least ``requested_delta``, larger
    when that was infeasible); ``objective`` is ``max(inbound_bytes)``.
    """

    layers: tuple[tuple[str, ...], ...]
    flops: tuple[float, ...]
    inbound_bytes: tuple[int, ...]
    delta: float
    requested_delta: float
    objective: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def layer_of(self) -> Mapping[str, int]:
        """Node name -> layer index, for every node of the graph."""
        return {name: j for j, names in enumerate(self.layers) for name in names}

    def layer_index(self, name: str) -> int:
        """The layer of node ``name``; KeyError if the graph has no such node."""
        return self.layer_of[name]


@dataclass(frozen=True)
class _Ops:
    """The op nodes as arrays: ``weight`` per op, ``reads[k]`` = ((producer index, bytes), ...)
    over the distinct op outputs that op k reads."""

    names: tuple[str, ...]
    weight: np.ndarray
    reads: tuple[tuple[tuple[int, int], ...], ...]


def _op_table(graph: Graph) -> _Ops:
    ops = [n for n in graph.nodes if n.role == "op"]
    index = {n.name: k for k, n in enumerate(ops)}
    reads = tuple(tuple((index[x], graph.by_name[x].out.nbytes)
                        for x in dict.fromkeys(n.inputs) if x in index) for n in ops)
    weight = np.array([float(n.flops) for n in ops], dtype=np.float64)
    if weight.sum() <= 0:
        weight = np.ones(len(ops), dtype=np.float64)
    return _Ops(tuple(n.name for n in ops), weight / weight.sum(), reads)


def _lead_cuts(ops: _Ops, num_layers: int) -> np.ndarray | None:
    """Where a layer may start so that the first one holds the program's first work: not
    among the ops before the first op weighing `LEAD_SHARE` of a layer's mean FLOPs, nor
    past `LEAD_MOST` of a layer (module docstring, "The first layer"); None (anywhere) when
    too few starts would be left for ``num_layers`` layers."""
    mean = 1.0 / num_layers   # ``weight`` sums to 1
    first = np.flatnonzero(ops.weight >= LEAD_SHARE * mean)
    within = np.flatnonzero(np.cumsum(ops.weight) >= LEAD_MOST * mean)
    lead = min(int(first[0]) if first.size else len(ops.names),
               int(within[0]) if within.size else len(ops.names))
    if lead == 0 or len(ops.names) - lead < num_layers:
        return None
    cuts = np.ones(len(ops.names) + 1, dtype=bool)
    cuts[1:lead + 1] = False
    return cuts


def _window_starts(prefix: np.ndarray, limit: float) -> np.ndarray:
    """``starts[k]``: the first op a layer ending at op k may start at under the FLOP limit
    (``prefix[k]`` is the weight of ops 0..k-1); ``starts[k] > k`` if op k alone exceeds it."""
    return np.searchsorted(prefix, prefix[1:] - limit, side="left")


def _num_parts_needed(starts: np.ndarray, cuts: np.ndarray | None = None) -> int | None:
    """Fewest layers meeting the limit, starting only where ``cuts`` allows (greedy from the
    end, each layer starting as early as allowed, is optimal); None if none does."""
    if cuts is None:
        if np.any(starts > np.arange(len(starts))):
            return None
        first = starts
    else:
        # The first allowed start at or after each op index.
        nxt = np.minimum.accumulate(np.where(cuts, np.arange(cuts.size), cuts.size)[::-1])[::-1]
        first = nxt[starts]
    k, parts = len(starts) - 1, 0
    while k >= 0:
        if first[k] > k:
            return None
        k, parts = int(first[k]) - 1, parts + 1
    return parts


def _resolve_delta(prefix: np.ndarray, num_layers: int, delta: float) -> tuple[float, np.ndarray]:
    """(δ used, window starts): δ doubled until L layers fit. Terminates: at δ ≥ L - 1 one
    layer may hold everything."""
    while True:
        starts = _window_starts(prefix, (1.0 + delta) / num_layers + _REL_TOL)
        parts = _num_parts_needed(starts)
        if parts is not None and parts <= num_layers:
            return delta, starts
        delta = max(2.0 * delta, MIN_RELAXED_DELTA)


def _inbound_windows(ops: _Ops, starts: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (k, lo, C(lo..k, k)) for k = 0..K-1 (0-based, both ends inclusive).

    The yielded array is a view that the next step updates: use it before advancing.
    """
    inbound = np.zeros(len(ops.names), dtype=np.float64)
    last_reader: dict[int, int] = {}
    for k, reads in enumerate(ops.reads):
        for producer, nbytes in reads:
            inbound[last_reader.get(producer, producer) + 1:k + 1] += nbytes
            last_reader[producer] = k
        yield k, int(starts[k]), inbound[starts[k]:k + 1]


def _row_range(k: int, num_ops: int, num_layers: int) -> tuple[int, int]:
    """Layer counts r (inclusive range) for which ops 0..k can form exactly r nonempty layers
    and the remaining ops still fill the other L - r."""
    return max(1, num_layers - (num_ops - 1 - k)), min(num_layers, k + 1)


def _allowed_inbound(inbound: np.ndarray, lo: int, k: int, cuts: np.ndarray | None
                     ) -> np.ndarray | None:
    """``inbound`` (C(lo..k, k)) with the layers that may not start where they do at inf, or
    None when no layer may end at op k (the next one may not start at k + 1); ``cuts``: None
    (anywhere) or whether a layer may start at each op index 0..K."""
    if cuts is None:
        return inbound
    if not cuts[k + 1]:
        return None
    return np.where(cuts[lo:k + 1], inbound, np.inf)


def _min_max_inbound(ops: _Ops, starts: np.ndarray, num_layers: int,
                     cuts: np.ndarray | None = None) -> float:
    """G(K, L): the smallest possible largest inbound bytes of a layer (inf when no split
    has layers starting only where ``cuts`` allows)."""
    num_ops = len(ops.names)
    best = np.full((num_layers + 1, num_ops + 1), np.inf)
    best[0, 0] = 0.0
    for k, lo, inbound in _inbound_windows(ops, starts):
        inbound = _allowed_inbound(inbound, lo, k, cuts)
        if inbound is None:
            continue
        r0, r1 = _row_range(k, num_ops, num_layers)
        prev = best[r0 - 1:r1, lo:k + 1]  # G(i-1, r-1) for prefix lengths i = lo..k
        best[r0:r1 + 1, k + 1] = np.maximum(prev, inbound).min(axis=1)
    return float(best[num_layers, num_ops])


def _least_square_split(ops: _Ops, starts: np.ndarray, prefix: np.ndarray,
                        num_layers: int, max_inbound: float, cuts: np.ndarray | None = None,
                        flops_first: bool = False) -> tuple[list[int], tuple[float, float]]:
    """Start index of each layer for the split with every C ≤ max_inbound of least Σ C, and
    among those of least Σ FLOP² (module docstring), layers starting only where ``cuts``
    allows; and (Σ C, Σ FLOP²). Both sums are additive, so the pair compared
    lexicographically is an exact DP; C are whole bytes, exact in floats. ``flops_first``:
    least Σ FLOP² first (to a relative 1e-9: sums of one set of layers in another order
    round differently), then least Σ C."""
    num_ops = len(ops.names)
    bytes_in = np.full((num_layers + 1, num_ops + 1), np.inf)
    bytes_in[0, 0] = 0.0
    cost = np.full((num_layers + 1, num_ops + 1), np.inf)
    cost[0, 0] = 0.0
    choice = np.zeros((num_layers + 1, num_ops + 1), dtype=np.int32)
    for k, lo, inbound in _inbound_windows(ops, starts):
        inbound = _allowed_inbound(inbound, lo, k, cuts)
        if inbound is None:
            continue
        r0, r1 = _row_range(k, num_ops, num_layers)
        square = (prefix[k + 1] - prefix[lo:k + 1]) ** 2
        received = np.where(inbound > max_inbound, np.inf, inbound)
        total_in = bytes_in[r0 - 1:r1, lo:k + 1] + received
        total = cost[r0 - 1:r1, lo:k + 1] + square
        if flops_first:
            total = np.where(np.isinf(total_in), np.inf, total)
            least = total.min(axis=1, keepdims=True)
            pick = np.where(total <= least * (1 + 1e-9), total_in, np.inf).argmin(axis=1)
        else:
            least = total_in.min(axis=1, keepdims=True)
            pick = np.where(total_in == least, total, np.inf).argmin(axis=1)
        rows = np.arange(len(pick))
        bytes_in[r0:r1 + 1, k + 1] = total_in[rows, pick]
        cost[r0:r1 + 1, k + 1] = total[rows, pick]
        choice[r0:r1 + 1, k + 1] = lo + pick
    starts_of, end = [], num_ops
    for r in range(num_layers, 0, -1):
        end = int(choice[r, end])
        starts_of.append(end)
    assert end == 0 and np.isfinite(bytes_in[num_layers, num_ops])
    return starts_of[::-1], (float(bytes_in[num_layers, num_ops]),
                             float(cost[num_layers, num_ops]))


def _check_args(num_ops: int, num_layers: int, delta: float) -> None:
    if num_ops == 0:
        raise ValueError("graph has no op nodes to cluster")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers <= num_ops:
        raise ValueError(f"num_layers={num_layers!r}: must be an int in [1, {num_ops}] "
                         f"(the number of op nodes)")
    if not np.isfinite(delta) or delta < 0:
        raise ValueError(f"delta={delta!r}: must be a finite float >= 0")


def cluster_layers(graph: Graph, num_layers: int, delta: float = DEFAULT_DELTA,
                   balance: str = "flops") -> Layering:
    """Cluster ``graph``'s ops into ``num_layers`` contiguous layers.

    ``balance="flops"``: by eq. 6 (module docstring); ``delta`` is the FLOP imbalance tolerated
    per layer, relaxed (doubled) when infeasible. ``balance="ops"``: Alpa's "equal operator"
    ablation (§8.4) — layers of equal op counts (within one), cut wherever that falls, no DP.
    Raises ValueError if ``num_layers`` is not in [1, number of op nodes], ``delta`` < 0 or
    ``balance`` is neither.
    """
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}: must be one of {BALANCES}")
    ops = _op_table(graph)
    _check_args(len(ops.names), num_layers, delta)
    if balance == "ops":
        cuts = [j * len(ops.names) // num_layers for j in range(num_layers)]
        return _assemble(graph, ops, cuts, float(delta), float(delta))
    prefix = np.concatenate([[0.0], np.cumsum(ops.weight)])
    used, starts = _resolve_delta(prefix, num_layers, float(delta))
    max_inbound = _min_max_inbound(ops, starts, num_layers)
    cuts = _least_square_split(ops, starts, prefix, num_layers, max_inbound)[0]
    cuts = _uniform_split(graph, ops, starts, prefix, num_layers, max_inbound) or cuts
    layering = _assemble(graph, ops, cuts, used, float(delta))
    assert layering.objective == max_inbound, (layering.objective, max_inbound)
    return layering


@dataclass(frozen=True)
class Repeats:
    """A stretch of the op sequence (graph order), ops ``start`` to ``end`` - 1, that repeats
    with a period of ``period`` ops (every op matches the one ``period`` later or earlier): a
    transformer's blocks. It may start and end inside a unit."""

    start: int
    end: int
    period: int
    copies: int = 0   # how many units the program holds (`repeated_unit`)

    @property
    def units(self) -> int:
        """Whole units in the stretch."""
        return (self.end - self.start) // self.period


def _signatures(graph: Graph) -> np.ndarray:
    """Per op node (graph order) an int naming its op, output shape and input shapes."""
    kinds: dict[tuple, int] = {}
    return np.array([kinds.setdefault((n.op, n.out.shape, tuple(graph.by_name[x].out.shape
                                                                for x in n.inputs)), len(kinds))
                     for n in graph.nodes if n.role == "op"], dtype=np.int64)


def repeated_unit(graph: Graph) -> Repeats | None:
    """The longest stretch of repeated units of the program's ops, or None (module
    docstring). Two ops match when their op, output shape and input shapes do; the periods
    tried are the distances between heavy ops of one kind (one or two apart, so a block with
    two matmuls of one shape still shows its period)."""
    return _repeated_unit(graph, _signatures(graph))


def _repeated_unit(graph: Graph, sig: np.ndarray) -> Repeats | None:
    ops = [n for n in graph.nodes if n.role == "op"]
    where: dict[int, list[int]] = {}   # heavy kind -> its op indices
    for k, n in enumerate(ops):
        if n.op in HEAVY_OPS:
            where.setdefault(int(sig[k]), []).append(k)
    periods = set()
    for positions in where.values():
        gaps = np.diff(positions)
        periods.update(gaps.tolist())
        periods.update((gaps[1:] + gaps[:-1]).tolist())
    best: Repeats | None = None
    for period in sorted(p for p in periods if 0 < p < len(ops)):
        same = np.concatenate([[False], sig[period:] == sig[:-period], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not edges.size:
            continue
        runs = edges[1::2] - edges[::2]
        j = int(np.argmax(runs))
        found = Repeats(int(edges[2 * j]), int(edges[2 * j]) + int(runs[j]) + period, period)
        if found.units >= 2 and (best is None or found.end - found.start > best.end - best.start):
            best = found
    if best is None:
        return None
    # The copies: the heavy ops around the stretch that follow the unit's heavy ops in order,
    # cyclically, over those of one unit, rounded down. Heavy ops only: a first block may
    # differ in light ones (Llama's, Gemma 2's masks made at first use). In order: an LM
    # head shaped like a block's matmul, or an encoder's blocks shaped like its decoder's
    # without their cross-attention, break the sequence.
    heavy = [k for k, n in enumerate(ops) if n.op in HEAVY_OPS]
    kinds = [int(sig[k]) for k in heavy]
    first = next((i for i, k in enumerate(heavy) if k >= best.start), len(heavy))
    unit = [x for x, k in zip(kinds, heavy) if best.start <= k < best.start + best.period]
    if not unit:
        return None
    end = first
    while end < len(kinds) and kinds[end] == unit[(end - first) % len(unit)]:
        end += 1
    begin = first
    while begin > 0 and kinds[begin - 1] == unit[(begin - 1 - first) % len(unit)]:
        begin -= 1
    return replace(best, copies=(end - begin) // len(unit))


def _crossing_bytes(ops: _Ops) -> np.ndarray:
    """``cross[p]``: bytes of op outputs made before op p and read at or after it (what a cut
    before op p sends on)."""
    diff = np.zeros(len(ops.names) + 2)
    last: dict[int, tuple[int, int]] = {}
    for k, reads in enumerate(ops.reads):
        for producer, nbytes in reads:
            last[producer] = (k, nbytes)
    for producer, (reader, nbytes) in last.items():
        diff[producer + 1] += nbytes
        diff[reader + 1] -= nbytes
    return np.cumsum(diff)[:len(ops.names) + 1]


# Phases of the repeated unit tried for uniform layers (those sending the fewest bytes).
MAX_PHASES = 4


def _unit_cuts(ops: _Ops, rep: Repeats | None, num_layers: int) -> list[np.ndarray]:
    """Per phase of the repeated unit ``rep`` worth trying, where a layer may start: at that
    phase of every unit inside the repeated stretch, anywhere outside it except among the ops
    before the program's first work (`_lead_cuts`, for ``num_layers`` layers). Empty when the
    program repeats nothing."""
    if rep is None:
        return []
    cross = _crossing_bytes(ops)[rep.start:rep.start + rep.period]
    phases = np.flatnonzero(cross == cross.min())[:MAX_PHASES] + rep.start
    # The stretch may end a few ops into a unit (a final norm shaped like a block's first):
    # within a unit either side of it too, layers start only at the phase.
    lo, hi = max(rep.start - rep.period, 0), min(rep.end + rep.period, len(ops.names))
    lead = _lead_cuts(ops, num_layers)
    out = []
    for phase in phases.tolist():
        cuts = np.ones(len(ops.names) + 1, dtype=bool)
        cuts[lo:hi + 1] = False
        cuts[lo + (phase - lo) % rep.period:hi + 1:rep.period] = True
        cuts[0] = cuts[-1] = True
        out.append(cuts if lead is None else cuts & lead)
    return out


def _blocks_and_a_head(ops: _Ops, prefix: np.ndarray, rep: Repeats) -> bool:
    """Whether the program is its repeated units and at most one op more of weight (an LM
    head): ``rep.copies`` units and the heaviest op outside the stretch hold `STRETCH_SHARE`
    of the FLOPs (``prefix``: the ops' weights' prefix sums, total 1)."""
    unit = prefix[rep.start + rep.period] - prefix[rep.start]
    outside = np.concatenate([ops.weight[:rep.start], ops.weight[rep.end:]])
    return rep.copies * unit + (outside.max() if outside.size else 0.0) >= STRETCH_SHARE


def _cuts_fit(starts: np.ndarray, cuts: np.ndarray, num_layers: int) -> bool:
    """Whether ``num_layers`` layers starting only where ``cuts`` allows meet the FLOP bound
    of ``starts`` (between the fewest such layers and one per allowed start)."""
    parts = _num_parts_needed(starts, cuts)
    return parts is not None and parts <= num_layers <= int(cuts[:-1].sum())


def _uniform_split(graph: Graph, ops: _Ops, starts: np.ndarray, prefix: np.ndarray,
                   num_layers: int, max_inbound: float) -> list[int] | None:
    """The layers' starts when some split cut only at one phase of the repeated unit reaches
    the same largest inbound bytes ``max_inbound`` under the same FLOP bound: of those, the
    one of fewest distinct layers, then least Σ C, then Σ FLOP² (least Σ FLOP² before Σ C
    where the program is its units and a head, `_blocks_and_a_head`; module docstring).
    None when the program repeats nothing or no such split does as well."""
    best: tuple[tuple[int, float, float], list[int]] | None = None
    sig = _signatures(graph)
    rep = _repeated_unit(graph, sig)
    flops_first = rep is not None and _blocks_and_a_head(ops, prefix, rep)
    for cuts in _unit_cuts(ops, rep, num_layers):
        if not _cuts_fit(starts, cuts, num_layers) or \
                _min_max_inbound(ops, starts, num_layers, cuts) > max_inbound:
            continue
        split, sums = _least_square_split(ops, starts, prefix, num_layers, max_inbound, cuts,
                                          flops_first)
        bounds = [*split, len(ops.names)]
        kinds = len({tuple(sig[a:b]) for a, b in zip(bounds, bounds[1:])})
        key = (kinds, sums[1], sums[0]) if flops_first else (kinds, *sums)
        if best is None or key < best[0]:
            best = (key, split)
    return None if best is None else best[1]


def _assemble(graph: Graph, ops: _Ops, cuts: list[int], delta: float, requested: float
              ) -> Layering:
    bounds = [*cuts, len(ops.names)]
    return layering_of(graph, {name: j for j in range(len(cuts))
                               for name in ops.names[bounds[j]:bounds[j + 1]]},
                       len(cuts), delta, requested)


def layering_of(graph: Graph, op_layer: Mapping[str, int], num_layers: int,
                delta: float = DEFAULT_DELTA, requested: float = DEFAULT_DELTA) -> Layering:
    """The `Layering` whose ops are in the layers ``op_layer`` gives (op name -> layer, every
    op of ``graph``); each source joins its first consumer's layer."""
    layer_of = dict(op_layer)
    for n in graph.nodes:   # sources join their first consumer's layer
        if n.role == "op":
            for x in n.inputs:
                layer_of.setdefault(x, layer_of[n.name])
    members: list[list[str]] = [[] for _ in range(num_layers)]
    for n in graph.nodes:
        members[layer_of.get(n.name, 0)].append(n.name)
    inbound = tuple(_inbound_bytes(graph, names) for names in members)
    flops = tuple(float(sum(graph.by_name[x].flops for x in names)) for names in members)
    return Layering(tuple(map(tuple, members)), flops, inbound, delta, requested, max(inbound))


def _inbound_bytes(graph: Graph, names: list[str]) -> int:
    """Bytes of distinct op outputs from outside the layer that the layer's ops read."""
    inside = set(names)
    outside = {x for name in names for x in graph.by_name[name].inputs
               if x not in inside and graph.by_name[x].role == "op"}
    return sum(graph.by_name[x].out.nbytes for x in outside)


def repeat_count(graph: Graph) -> int:
    """How often the program's repeated unit occurs (1 if none): heavy ops are grouped by kind
    (op, operand shapes, output shape); n is the commonest count among kinds seen more than once
    (the larger on a tie), if kinds whose count is a multiple of n hold at least half the heavy
    ops. The commonest count, not the gcd, so one extra op of a block's shape (an LM head shaped
    like an MLP matmul) does not hide the repetition."""
    kinds = Counter((n.op, tuple(graph.by_name[x].out.shape for x in n.inputs), n.out.shape)
                    for n in graph.nodes if n.role == "op" and n.op in HEAVY_OPS)
    counts = Counter(m for m in kinds.values() if m > 1)
    if not counts:
        return 1
    repeats = max(counts, key=lambda m: (counts[m], m))
    covered = sum(m for m in kinds.values() if m % repeats == 0)
    return repeats if 2 * covered >= sum(kinds.values()) else 1


def default_num_layers(graph: Graph, num_devices: int) -> int:
    """A sensible L for `cluster_layers` (rule in the module docstring), in [1, op count].

    Raises ValueError if ``num_devices`` is not an int >= 1 or the graph has no ops.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r}: must be an int >= 1")
    num_ops = sum(n.role == "op" for n in graph.nodes)
    if num_ops == 0:
        raise ValueError("graph has no op nodes to cluster")
    num_heavy = sum(n.role == "op" and n.op in HEAVY_OPS for n in graph.nodes)
    target = max(1, min(LAYERS_PER_DEVICE * num_devices, num_heavy // MIN_HEAVY_PER_LAYER,
                        num_ops))
    rep = repeated_unit(graph)
    repeats = rep.copies if rep is not None else repeat_count(graph)
    even = max(d for d in range(1, min(repeats, target) + 1) if repeats % d == 0)
    if not (repeats > 1 and (even == repeats or 2 * even >= target)):
        return target
    # Whole units per layer may leave the head (or the embedding) too heavy to share a layer
    # with a unit: then one or two layers more let every middle layer hold whole units.
    ops = _op_table(graph)
    prefix = np.concatenate([[0.0], np.cumsum(ops.weight)])
    for num_layers in range(even, min(even + MAX_EXTRA_LAYERS, num_ops) + 1):
        starts = _window_starts(prefix, (1.0 + DEFAULT_DELTA) / num_layers + _REL_TOL)
        if any(_cuts_fit(starts, cuts, num_layers) for cuts in _unit_cuts(ops, rep,
                                                                         num_layers)):
            return num_layers
    return even
