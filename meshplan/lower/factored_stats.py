"""The all-reduces that complete a factored optimizer's statistics over a parameter's shards.

Adafactor's update needs sums over whole dimensions of a parameter: the parameter's and the
update's sums of squares (its step scales with their RMS), each row's and each column's sum of
squared gradients, and the mean of the row statistics. A rank holding one piece of the parameter
computes partial sums; all-reduces over the mesh axes splitting the summed dims complete them.
The planner lists these collectives in the plan and the runtime runs them, both from
`factored_buckets`, so the two agree by construction.

Three rounds, each needing the one before:
  1. Σ parameter² (over every axis splitting the parameter); for ≥ 2-D parameters Σ g² of each
     row (over the axes splitting the last dim) and of each column (over those splitting dim -2);
  2. Σ over rows of the row statistic, per leading index (over the axes splitting dim -2);
  3. Σ update² (over every axis splitting the parameter).
In a round, the pieces of all parameters reduced over the same axes form one bucket, in
parameter order. Each piece is padded to the largest shard's size (ceil), so a bucket has the
size the plan lists on every rank, uneven shards included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Axes = tuple[int, ...]
ROUNDS = 3


@dataclass(frozen=True)
class StatPiece:
    """One parameter's partial sums in a bucket: ``what`` is "param_sq", "row", "col",
    "row_sum" or "update_sq"; ``numel`` its padded element count."""

    param: int
    what: str
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: the pieces of round ``round`` summed over ``axes``."""

    round: int
    axes: Axes
    pieces: tuple[StatPiece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def update_dims(layout_dims: Sequence[Axes], mode: str, sync_axes: Axes) -> tuple[Axes, ...]:
    """Mesh axes splitting each dim of the tensor a rank updates: its layout's, with ZeRO's
    data-parallel axes further splitting dim 0 (the runtime's `torch.tensor_split` of the
    local tensor)."""
    dims = tuple(tuple(d) for d in layout_dims)
    if mode == "replicated" or not sync_axes or not dims:
        return dims
    return ((*dims[0], *sync_axes), *dims[1:])


def _pad(size: int, axes: Axes, mesh_shape: Sequence[int]) -> int:
    return -(-size // math.prod(mesh_shape[a] for a in axes))


def _pieces(i: int, shape: Sequence[int], dims: Sequence[Axes], mesh_shape: Sequence[int]
            ) -> list[tuple[int, Axes, StatPiece]]:
    every = tuple(sorted({a for d in dims for a in d}))
    out = []
    if every:
        out.append((1, every, StatPiece(i, "param_sq", 1)))
    if len(shape) >= 2:
        sizes = [_pad(n, d, mesh_shape) for n, d in zip(shape, dims)]
        lead = math.prod(sizes[:-2])
        if dims[-1]:
            out.append((1, tuple(sorted(dims[-1])), StatPiece(i, "row", lead * sizes[-2])))
        if dims[-2]:
            axes = tuple(sorted(dims[-2]))
            out.append((1, axes, StatPiece(i, "col", lead * sizes[-1])))
            out.append((2, axes, StatPiece(i, "row_sum", lead)))
    if every:
        out.append((3, every, StatPiece(i, "update_sq", 1)))
    return out


def factored_buckets(shapes: Sequence[Sequence[int]], dims: Sequence[Sequence[Axes]],
                     mesh_shape: Sequence[int]) -> list[Bucket]:
    """The buckets of parameters of full ``shapes`` whose updated tensors are split as ``dims``
    (`update_dims`) on a mesh of ``mesh_shape``, by round then axes."""
    grouped: dict[tuple[int, Axes], list[StatPiece]] = {}
    for i, (shape, d) in enumerate(zip(shapes, dims)):
        for rnd, axes, piece in _pieces(i, tuple(shape), tuple(d), mesh_shape):
            grouped.setdefault((rnd, axes), []).append(piece)
    return [Bucket(r, a, tuple(p)) for (r, a), p in sorted(grouped.items())]
