"""Sharding strategies derived from dimension signatures (Alpa §4.1, Table 3, without tables).

A strategy assigns mesh axes to atoms of an op's signature. From the assignment follow the layout
each operand must arrive in, the layout of the output (a split reduced atom leaves a partial sum),
and, per operand, the axes over which that operand's gradient is partial: the work is split over
an axis while the operand is replicated on it, so each device sees only its share of the
operand's uses (Megatron's *f*; DP's gradient all-reduce).

Contractions get every assignment (`enumerate_strategies`); other ops *follow* the layout of
their main operand (`follow`), which is Alpa's follower merging.
"""

from __future__ import annotations

import itertools
from functools import cached_property, lru_cache
from dataclasses import dataclass
from typing import Sequence

from meshplan.ir.signatures import Dims, Signature
from meshplan.planner.intra.layout import Axes, Layout

Assignment = tuple[tuple[str, Axes], ...]  # (atom, axes) sorted by atom


@dataclass(frozen=True)
class Strategy:
    """One way to run one op on the mesh (see the module docstring)."""

    assign: Assignment
    inputs: tuple[Layout, ...]
    output: Layout
    grad_partial: tuple[Axes, ...]
    sync_axes: Axes = ()   # axes over which the op all-reduces its statistics (batch norm)

    @cached_property   # a key of the compute prices, read per choice and node
    def work_axes(self) -> Axes:
        """Mesh axes the op's arithmetic is divided over."""
        return tuple(sorted(a for _, axes in self.assign for a in axes))

    def describe(self, sig: Signature | None = None) -> str:
        """E.g. ``i:S0 j:S1`` for a matmul; generated atoms are named by where they appear
        (``out0`` = output dim 0, ``in1.0`` = dim 0 of operand 1, ``red`` = reduced)."""
        if not self.assign:
            return "replicated"
        return " ".join(f"{_atom_name(atom, sig)}:S{''.join(map(str, axes))}"
                        for atom, axes in self.assign)


def _atom_name(atom: str, sig: Signature | None) -> str:
    if atom.isascii() or sig is None:
        return atom
    for d, dims in enumerate(sig.output):
        if dims and dims[0] == atom:
            return f"out{d}"
    for j, ins in enumerate(sig.inputs):
        for d, dims in enumerate(ins):
            if dims and dims[0] == atom:
                return f"in{j}.{d}"
    return "red"


def _layout_of(dims: Dims, amap: dict[str, Axes]) -> Layout | None:
    out = []
    for d in dims:
        for i, atom in enumerate(d):
            if i > 0 and amap.get(atom):
                return None  # a non-leading atom cannot be split: its pieces are not contiguous
        out.append(amap.get(d[0], ()) if d else ())
    return Layout(tuple(out))


def strategy_from_assignment(sig: Signature, amap: dict[str, Axes]) -> Strategy | None:
    """Build the strategy of an assignment, or None if some operand cannot realize it."""
    amap = {a: ax for a, ax in amap.items() if ax}
    ins = []
    for dims in sig.inputs:
        lay = _layout_of(dims, amap)
        if lay is None:
            return None
        ins.append(lay)
    out = _layout_of(sig.output, amap)
    if out is None:
        return None
    out_atoms = set("".join(sig.output))
    partial = tuple(sorted(a for atom, ax in amap.items() if atom not in out_atoms for a in ax))
    grads = []
    for dims in sig.inputs:
        present = set("".join(dims))
        grads.append(tuple(sorted(a for atom, ax in amap.items() if atom not in present
                                  for a in ax)))
    sync: Axes = ()
    if sig.sync is not None:
        sync = tuple(sorted(a for atom, ax in amap.items() if atom in sig.sync.sync_atoms
                            for a in ax))
    return Strategy(tuple(sorted(amap.items())), tuple(ins), Layout(out.dims, partial),
                    tuple(grads), sync)


def _axis_options(atoms: Sequence[str], axes: Axes) -> list[dict[str, Axes]]:
    """Every map of each axis to one atom or to nothing; two axes on one atom make S01."""
    out = []
    for choice in itertools.product([None, *atoms], repeat=len(axes)):
        amap: dict[str, Axes] = {}
        for axis, atom in zip(axes, choice):
            if atom is not None:
                amap[atom] = (*amap.get(atom, ()), axis)
        out.append(amap)
    return out


@lru_cache(maxsize=None)
def enumerate_strategies(sig: Signature, axes: Axes, mesh_shape: tuple[int, ...], *,
                         full_split: bool = False) -> tuple[Strategy, ...]:
    """All strategies of an op over the active mesh ``axes``.

    ``full_split`` keeps only strategies dividing the work over every active axis (Alpa's rule
    for heavy ops when compute is left out of the objective). Atoms that do not cut into equal
    pieces over their group are not split.
    """
    atoms = sig.splittable_atoms()
    sizes = dict(sig.atom_sizes)
    out = []
    for amap in _axis_options(atoms, axes):
        if any(not _divides(ax, sizes.get(a, 0), mesh_shape) for a, ax in amap.items()):
            continue
        if full_split and sum(len(ax) for ax in amap.values()) < len(axes):
            continue
        s = strategy_from_assignment(sig, amap)
        if s is not None:
            out.append(s)
    return tuple(out)


def _divides(axes: Axes, size: int, mesh_shape: Sequence[int]) -> bool:
    """Whether ``size`` cuts into equal pieces over ``axes``: the planner splits only so, as
    Megatron pads a vocabulary, so the one collective list of a plan holds on every rank (uneven
    shards of a heterogeneous cluster come from per-axis weights, not from odd sizes)."""
    group = _group(axes, mesh_shape)
    return size >= group and size % group == 0


def _group(axes: Axes, mesh_shape: Sequence[int]) -> int:
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


@lru_cache(maxsize=None)
def follow(sig: Signature, main: int, layout: Layout, mesh_shape: Sequence[int]) -> Strategy:
    """The strategy of a follower whose operand ``main`` arrives in ``layout``.

    The follower keeps every split it can; a partial sum is reduced first (followers take no
    partial inputs), and splits of atoms the op cannot split (a softmax's dim, a merged view's
    inner dim) are gathered.
    """
    sizes = dict(sig.atom_sizes)
    ok = set(sig.splittable_atoms())
    amap: dict[str, Axes] = {}
    for dims, axes in zip(sig.inputs[main], layout.dims):
        if axes and dims and dims[0] in ok and _divides(axes, sizes.get(dims[0], 0), mesh_shape):
            amap[dims[0]] = axes
    s = strategy_from_assignment(sig, amap)
    while s is None:  # drop splits until every operand can realize the rest
        amap.pop(next(iter(amap)))
        s = strategy_from_assignment(sig, amap)
    return s


def replicated_strategy(sig: Signature) -> Strategy:
    s = strategy_from_assignment(sig, {})
    assert s is not None
    return s


def source_layouts(ndim: int, sizes: Sequence[int], axes: Axes, mesh_shape: Sequence[int]
                   ) -> list[Layout]:
    """Every layout of a source tensor (a parameter or an input) over the active ``axes``."""
    out = []
    for choice in itertools.product([None, *range(ndim)], repeat=len(axes)):
        dims: list[Axes] = [()] * ndim
        for axis, d in zip(axes, choice):
            if d is not None:
                dims[d] = (*dims[d], axis)
        if all(_divides(ax, sizes[d], mesh_shape) for d, ax in enumerate(dims) if ax):
            out.append(Layout(tuple(dims)))
    return out
