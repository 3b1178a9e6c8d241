"""Sharding specs of one tensor on a 2-D logical mesh.

A `Layout` says, for each tensor dim, which mesh axes split it (``()`` replicated ``R``, ``(0,)``
``S0``, ``(1,)`` ``S1``, ``(0, 1)`` ``S01`` — axis 0 outer, axis 1 inner), and over which axes the
value is a partial sum (state ``P``). Layouts are small immutable values: hashable, cheap to
compare, usable as cache keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

Axes = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Per tensor dim, the mesh axes splitting it; and the axes of pending partial sums."""

    dims: tuple[Axes, ...]
    partial: Axes = ()

    def __hash__(self) -> int:
        # Remembered: layouts key the planner's caches (reshard recipes, operand classes) and
        # are hashed millions of times. Of ints only, so the same in every process.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dims, self.partial))
            object.__setattr__(self, "_hash", h)
        return h

    @staticmethod
    def replicated(ndim: int) -> Layout:
        return Layout(((),) * ndim)

    @cached_property   # read per strategy pair by the formulations: made once per layout
    def split_axes(self) -> Axes:
        return tuple(sorted(a for d in self.dims for a in d))

    def is_replicated(self) -> bool:
        return not self.split_axes and not self.partial

    def axis_dim(self, axis: int) -> int | None:
        """The tensor dim split over ``axis``, if any."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def shard_factor(self, mesh_shape: Sequence[int]) -> int:
        """How many pieces the tensor is cut into (partial sums do not shrink a tensor)."""
        return math.prod(mesh_shape[a] for a in self.split_axes)

    def spec(self) -> str:
        """``"S0,R"``-style string, one entry per dim; ``"P1"`` appended for partial sums."""
        parts = ["R" if not d else "S" + "".join(map(str, d)) for d in self.dims]
        if self.partial:
            parts.append("P" + "".join(map(str, self.partial)))
        return ",".join(parts) if parts else "scalar"

    @staticmethod
    def parse(spec: str, ndim: int) -> Layout:
        """Inverse of `spec` (``"scalar"`` for 0-d). Raises ValueError on a malformed spec."""
        if spec == "scalar":
            return Layout(())
        parts = spec.split(",")
        partial: Axes = ()
        if parts and parts[-1].startswith("P"):
            partial = tuple(int(c) for c in parts.pop()[1:])
        if len(parts) != ndim or any(p != "R" and not p.startswith("S") for p in parts):
            raise ValueError(f"bad sharding spec {spec!r} for a {ndim}-d tensor: expected "
                             f"{ndim} comma-separated entries of R, S0, S1 or S01")
        return Layout(tuple(() if p == "R" else tuple(int(c) for c in p[1:]) for p in parts),
                      partial)


def active_axes(mesh_shape: Sequence[int]) -> Axes:
    """Mesh axes with more than one device: the only ones worth splitting over."""
    return tuple(a for a, n in enumerate(mesh_shape) if n > 1)


def normalize_axes(axes: Sequence[int], mesh_shape: Sequence[int]) -> Axes:
    """Drop axes of size 1 (no collective runs over them) and sort."""
    return tuple(sorted(a for a in axes if mesh_shape[a] > 1))


def split_sizes(n: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Cut ``n`` into ``len(weights)`` pieces proportional to ``weights``.

    Equal weights give ``torch.tensor_split`` sizes (the first ``n % k`` pieces one larger);
    unequal weights (a heterogeneous cluster, or a user's uneven batch) use largest remainders,
    with at least one row for every member of positive weight when ``n`` allows.
    """
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"shard weights must be non-negative with a positive sum, got {weights}")
    exact = [n * w / total for w in weights]
    base = [int(math.floor(e + 1e-9)) for e in exact]
    rest = n - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    # Every member with a share gets a row while there are rows enough: an empty shard
    # saves nothing and some kernels fail on empty tensors (CPU attention over zero heads).
    if n >= sum(1 for w in weights if w > 0):
        for i in range(len(base)):
            if base[i] == 0 and weights[i] > 0:
                base[base.index(max(base))] -= 1
                base[i] = 1
    return tuple(base)


def canonical_sizes(n: int, axes: Axes, weights: Sequence[Sequence[float]]) -> tuple[int, ...]:
    """Piece sizes of a dim of size ``n`` split over ``axes`` (outer axis first), flat in the
    order of the group over those axes. ``weights[a]`` are the per-position weights of axis a."""
    pieces = [n]
    for a in axes:
        pieces = [s for p in pieces for s in split_sizes(p, weights[a])]
    return tuple(pieces)
