"""Shard bookkeeping for lowering: which piece of each tensor dim a rank holds, and how big.

Every value of a lowered program carries its layout and, per split dim, the sizes of all pieces
over that dim's mesh axes (flat, outer axis first). Sizes are never assumed equal: new splits
are cut with `canonical_sizes` (tensor_split sizes, or the plan's per-axis weights for uneven
shards), and sizes flow through ops atom by atom, so a view of an unevenly split batch stays
consistent with everything else derived from that batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from meshplan.ir.signatures import Signature
from meshplan.planner.intra.layout import Axes, Layout, canonical_sizes


@dataclass(frozen=True)
class Sharded:
    """A value's global shape, layout and per-dim piece sizes (``None`` for an unsplit dim)."""

    shape: tuple[int, ...]
    layout: Layout
    pieces: tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True)
class MeshPos:
    """A rank's place in the mesh and the mesh's per-axis shard weights."""

    shape: tuple[int, int]
    rank: int
    weights: tuple[tuple[float, ...], tuple[float, ...]]

    @property
    def coords(self) -> tuple[int, int]:
        return divmod(self.rank, self.shape[1])

    def index(self, axes: Axes) -> int:
        """My position in the group over ``axes`` (outer axis first)."""
        i = 0
        for a in axes:
            i = i * self.shape[a] + self.coords[a]
        return i

    def group(self, axes: Axes) -> int:
        return math.prod(self.shape[a] for a in axes)


def uneven(weights: Sequence[Sequence[float]]) -> bool:
    """Whether some axis gives its positions different shares."""
    return any(len(set(w)) > 1 for w in weights)


def cut(n: int, axes: Axes, weights: Sequence[Sequence[float]], unit: int = 1
        ) -> tuple[int, ...]:
    """`canonical_sizes` of a dim of ``n`` whose pieces are whole ``unit`` s
    (`grain.cut_units`) on a mesh with uneven weights — on any axis: a piece an uneven axis
    cut may then be cut evenly over another. On an even mesh, as before (the planner checked
    that every split divides)."""
    if unit == 1 or not uneven(weights):
        return canonical_sizes(n, axes, weights)
    return tuple(unit * p for p in canonical_sizes(n // unit, axes, weights))


def even_weights(shape: tuple[int, int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return (tuple([1.0] * shape[0]), tuple([1.0] * shape[1]))


def source_sharded(shape: tuple[int, ...], layout: Layout, pos: MeshPos,
                   units: Sequence[int] = ()) -> Sharded:
    units = units or (1,) * len(shape)
    return Sharded(shape, layout, tuple(cut(n, ax, pos.weights, u) if ax else None
                                        for n, ax, u in zip(shape, layout.dims, units)))


def local_shape(v: Sharded, pos: MeshPos) -> tuple[int, ...]:
    return tuple(n if p is None else p[pos.index(ax)]
                 for n, p, ax in zip(v.shape, v.pieces, v.layout.dims))


def gathered(v: Sharded, dim: int, axes: Axes, pos: MeshPos) -> tuple[Sharded, tuple[int, ...]]:
    """After gathering the trailing ``axes`` of ``dim``: the new value and the member sizes."""
    cur = v.layout.dims[dim]
    keep = cur[:len(cur) - len(axes)]
    assert cur[len(keep):] == axes, (cur, axes)
    pieces = v.pieces[dim]
    g = pos.group(axes)
    start = pos.index(keep) * g
    members = pieces[start:start + g]
    new_pieces = tuple(sum(pieces[i:i + g]) for i in range(0, len(pieces), g)) if keep else None
    return _with_dim(v, dim, keep, new_pieces), tuple(members)


def split_more(v: Sharded, dim: int, axes: Axes, pos: MeshPos, unit: int = 1
               ) -> tuple[Sharded, tuple[int, ...]]:
    """After cutting ``dim`` further over ``axes`` (in whole ``unit`` s): the new value and my
    group's piece sizes."""
    cur = v.layout.dims[dim]
    before = v.pieces[dim] or (v.shape[dim],)
    new = tuple(s for p in before for s in cut(p, axes, pos.weights, unit))
    g = pos.group(axes)
    start = pos.index(cur) * g if cur else 0
    return _with_dim(v, dim, (*cur, *axes), new), new[start:start + g]


def _with_dim(v: Sharded, dim: int, axes: Axes, pieces: tuple[int, ...] | None) -> Sharded:
    dims = list(v.layout.dims)
    dims[dim] = axes
    all_pieces = list(v.pieces)
    all_pieces[dim] = pieces
    return Sharded(v.shape, Layout(tuple(dims), v.layout.partial), tuple(all_pieces))


def with_partial(v: Sharded, partial: Axes) -> Sharded:
    return Sharded(v.shape, Layout(v.layout.dims, partial), v.pieces)


def op_output(sig: Signature, operands: Sequence[Sharded], out_shape: tuple[int, ...],
              out_layout: Layout, pos: MeshPos, units: Sequence[int] = ()) -> Sharded:
    """Piece sizes of an op's output, carried atom by atom from operands that split the atom
    (else cut anew, in whole ``units``)."""
    units = units or (1,) * len(out_shape)
    sizes = dict(sig.atom_sizes)
    pieces: list[tuple[int, ...] | None] = []
    for d, axes in enumerate(out_layout.dims):
        if not axes:
            pieces.append(None)
            continue
        atom = sig.output[d][0]
        found = None
        for dims, v in zip(sig.inputs, operands):
            for e, ddims in enumerate(dims):
                if ddims and ddims[0] == atom and v.layout.dims[e] == axes:
                    rest = v.shape[e] // sizes[atom]
                    cand = tuple(p // rest for p in v.pieces[e])
                    if found is not None and cand != found:
                        raise AssertionError(f"operands disagree on the shard sizes of one dim: "
                                             f"{found} vs {cand}")
                    found = cand
        scale = out_shape[d] // sizes[atom]
        pieces.append(tuple(p * scale for p in found) if found is not None
                      else cut(out_shape[d], axes, pos.weights, units[d]))
    return Sharded(out_shape, out_layout, tuple(pieces))


def take_local(full: "torch.Tensor", v: Sharded, pos: MeshPos, have: tuple[int, ...] = ()
               ) -> "torch.Tensor":
    """This rank's piece of a full tensor laid out as ``v`` (partial sums are not a slicing);
    dims ``have`` are this rank's piece already (rank-local loading's rows)."""
    out = full
    for d, (axes, pieces) in enumerate(zip(v.layout.dims, v.pieces)):
        if axes and d not in have:
            i = pos.index(axes)
            out = out.narrow(d, sum(pieces[:i]), pieces[i])
    return out.contiguous()


def piece_offsets(v: Sharded, pos: MeshPos) -> tuple[tuple[int, int], ...]:
    """(start, length) of this rank's piece along every dim of the global tensor."""
    out = []
    for n, p, ax in zip(v.shape, v.pieces, v.layout.dims):
        if p is None:
            out.append((0, n))
        else:
            i = pos.index(ax)
            out.append((sum(p[:i]), p[i]))
    return tuple(out)
