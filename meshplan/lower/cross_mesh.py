"""Cross-mesh resharding (Alpa §6): move a value from the ranks of one stage's mesh, laid out
one way, to the ranks of another stage's mesh, laid out another way.

Each rank of a mesh holds a *tile* of the global tensor: per dim, the piece its position over
that dim's mesh axes selects (`tiles`). A destination tile is assembled from the source tiles it
overlaps, one point-to-point transfer per overlap (`Transfer`, a box of global indices). Where
source ranks hold the same tile (replicas), each transfer is read from one of them, spread over
the replicas so no source rank sends everything. Source partial sums (layout ``partial`` axes)
are summed by the receiver: it gets the overlap from one rank per partial member.

Local all-gather (Alpa's optimization). When the destination replicates its tiles (k ranks
hold the same tile), sending the whole tile to each of the k ranks moves k copies across the
slow link between meshes. Instead the tile is cut into k slices along its longest dim, each
replica receives one slice from the source mesh, and the k replicas all-gather the slices
(`LocalGather`) over the fast links inside a host. Replicas on different hosts gather apart,
host by host: one gather across hosts would move each device's missing (H-1)/H of the tile
over the network (d devices of a host: d(H-1)/H tiles into each host, 6 on four hosts of
eight), where a copy per host moves one. Each distinct tile then crosses once into each host
that holds it. (A host's replicas of a tile with fewer rows along that dim than they are, or
of a partial source, each receive it whole.)

The plan is plain data (the runtime and the simulator read it), ranks are global ranks, and
boxes are global ``(start, stop)`` per dim: a receiver places a transfer at
``box - its tile's start``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from meshplan.planner.intra.layout import Layout, canonical_sizes

Box = tuple[tuple[int, int], ...]   # per dim, global [start, stop)


@dataclass(frozen=True)
class MeshRanks:
    """A stage's mesh: its logical shape, the global rank at each position (row-major), and its
    per-axis shard weights (even when None)."""

    shape: tuple[int, int]
    ranks: tuple[int, ...]
    weights: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or math.prod(self.shape) != len(self.ranks) or \
                len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a {self.shape} mesh needs {math.prod(self.shape)} distinct ranks, "
                             f"got {self.ranks}")

    @property
    def axis_weights(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return self.weights or (tuple([1.0] * self.shape[0]), tuple([1.0] * self.shape[1]))

    def coords(self, position: int) -> tuple[int, int]:
        return divmod(position, self.shape[1])


@dataclass(frozen=True)
class Transfer:
    """``box`` of the value sent from global rank ``src`` to ``dst``; ``summed`` when the
    receiver adds it to what it has (a partial-sum source), else it is placed."""

    src: int
    dst: int
    box: Box
    nbytes: int
    summed: bool = False


@dataclass(frozen=True)
class LocalGather:
    """After the transfers: ``ranks`` (of the destination mesh, in slice order) hold one slice
    each of ``box`` along ``dim`` (``cuts`` the slice boundaries) and all-gather it."""

    ranks: tuple[int, ...]
    box: Box
    dim: int
    cuts: tuple[int, ...]


@dataclass(frozen=True)
class ReshardPlan:
    """Everything one value's move between two meshes takes."""

    shape: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    gathers: tuple[LocalGather, ...]
    dst_tiles: dict[int, Box]

    @property
    def cross_bytes(self) -> int:
        """Bytes sent between different ranks (a rank in both meshes keeps its own part)."""
        return sum(t.nbytes for t in self.transfers if t.src != t.dst)


def tiles(shape: Sequence[int], layout: Layout, mesh: MeshRanks) -> dict[int, Box]:
    """Global rank -> the box of the tensor it holds under ``layout`` (partial axes ignored)."""
    if len(layout.dims) != len(shape):
        raise ValueError(f"layout {layout.spec()} has {len(layout.dims)} dims, the value "
                         f"{len(shape)}")
    for a in layout.split_axes + tuple(layout.partial):
        if a not in (0, 1):
            raise ValueError(f"layout {layout.spec()} names mesh axis {a}; a mesh has axes 0, 1")
    out = {}
    for position, rank in enumerate(mesh.ranks):
        coords = mesh.coords(position)
        box = []
        for n, axes in zip(shape, layout.dims):
            sizes = canonical_sizes(n, axes, mesh.axis_weights)
            index = 0
            for a in axes:
                index = index * mesh.shape[a] + coords[a]
            start = sum(sizes[:index])
            box.append((start, start + (sizes[index] if axes else n)))
        out[rank] = tuple(box)
    return out


def plan_reshard(shape: Sequence[int], itemsize: int, src: MeshRanks, src_layout: Layout,
                 dst: MeshRanks, dst_layout: Layout, *, local_gather: bool = True,
                 devices_per_host: int | None = None) -> ReshardPlan:
    """The transfers (and local all-gathers) that give every rank of ``dst`` its tile under
    ``dst_layout`` from ``src``'s tiles under ``src_layout`` (module docstring); global rank r
    sits on host ``r // devices_per_host`` (None: all on one host). Raises ValueError for a
    partial destination or layouts that do not fit the value or the meshes."""
    shape = tuple(int(n) for n in shape)
    if dst_layout.partial:
        raise ValueError(f"destination layout {dst_layout.spec()} is partial; a value arrives "
                         "whole (its partial sums are reduced by the move)")
    src_tiles, dst_tiles = tiles(shape, src_layout, src), tiles(shape, dst_layout, dst)
    holders = _holders(src, src_layout, src_tiles)
    partial = bool(src_layout.partial)
    by_tile: dict[tuple[Box, int], list[int]] = {}   # a tile's receivers on one host
    for rank in dst.ranks:
        host = rank // devices_per_host if devices_per_host else 0
        by_tile.setdefault((dst_tiles[rank], host), []).append(rank)
    sent: dict[int, int] = {r: 0 for r in src.ranks}   # bytes per source, to spread replicas
    transfers: list[Transfer] = []
    gathers: list[LocalGather] = []
    for (box, _), receivers in by_tile.items():
        dim = max(range(len(shape)), key=lambda d: box[d][1] - box[d][0], default=None)
        split = (local_gather and len(receivers) > 1 and not partial and dim is not None
                 and box[dim][1] - box[dim][0] >= len(receivers))
        if split:
            cuts = _cuts(box[dim], len(receivers))
            for k, rank in enumerate(receivers):
                piece = box[:dim] + ((cuts[k], cuts[k + 1]),) + box[dim + 1:]
                transfers += _fetch(piece, rank, holders, itemsize, sent, partial)
            gathers.append(LocalGather(tuple(receivers), box, dim, tuple(cuts)))
        else:
            for rank in receivers:
                transfers += _fetch(box, rank, holders, itemsize, sent, partial)
    return ReshardPlan(shape, tuple(transfers), tuple(gathers), dst_tiles)


def _holders(mesh: MeshRanks, layout: Layout, src_tiles: dict[int, Box]
             ) -> list[tuple[Box, list[int]]]:
    """Per distinct (tile, partial member): the tile and the ranks holding that very part."""
    groups: dict[tuple, list[int]] = {}
    for position, rank in enumerate(mesh.ranks):
        coords = mesh.coords(position)
        member = tuple(coords[a] for a in layout.partial)
        groups.setdefault((src_tiles[rank], member), []).append(rank)
    return [(box, ranks) for (box, _), ranks in groups.items()]


def _fetch(box: Box, dst: int, holders: list[tuple[Box, list[int]]], itemsize: int,
           sent: dict[int, int], partial: bool) -> list[Transfer]:
    """Transfers covering ``box`` for ``dst``: per source part overlapping it, from the dst
    itself when it holds that part, else from the holder that has sent least so far."""
    out = []
    for tile, ranks in holders:
        overlap = _intersect(box, tile)
        if overlap is None:
            continue
        nbytes = itemsize * math.prod(b - a for a, b in overlap)
        src = dst if dst in ranks else min(ranks, key=lambda r: (sent[r], r))
        sent[src] += nbytes
        out.append(Transfer(src, dst, overlap, nbytes, partial))
    return out


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


def _cuts(span: tuple[int, int], k: int) -> list[int]:
    """``k + 1`` boundaries cutting ``span`` into k near-equal slices (tensor_split's sizes)."""
    n, lo = span[1] - span[0], span[0]
    return [lo + (n // k) * i + min(i, n % k) for i in range(k + 1)]
