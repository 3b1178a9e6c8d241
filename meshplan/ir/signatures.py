"""Dimension signatures: each op's semantics as an einsum-like relation between dims.

A signature names the *atoms* of an op's iteration space. Every tensor dim is a string of one or
more atoms: ``mm`` is ``ik,kj->ij`` (dims ``"i"``, ``"k"`` / ``"k"``, ``"j"`` / ``"i"``, ``"j"``);
a view that merges batch and sequence is ``("b","s","h") -> ("bs","h")``. Splitting an atom over a
mesh axis splits every dim whose *leading* atom it is (a contiguous block) — an atom that is not the
leading atom of some dim it appears in cannot be split. Atoms absent from the output are reduced:
splitting one leaves the output as a partial sum (state ``P``). ``unsplittable`` atoms (softmax's
dim, layer norm's normalized dims, attention's sequence) are never split. ``mean_atoms`` are reduced
by a mean rather than a sum, so a split one divides by the global count.

Signatures are plain data; `meshplan.capture.signature_rules` derives them from aten ops, and the
planner derives all strategies (Alpa's Table 3) from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from functools import cached_property

Dims = tuple[str, ...]


@dataclass(frozen=True)
class StatSync:
    """Statistics an op reduces over ``sync_atoms`` (batch norm's mean and variance over the
    batch; a softmax's max and sum over a split class dim): splitting one of those atoms makes
    the op exchange its statistics, of ``nbytes`` unsplit, cut like the ``stat_atoms``.
    ``collectives`` are (kind, backward) pairs, in order: an ``all_reduce`` whose backward is an
    all-reduce too, or an ``all_gather`` (of a detached value) with no backward.
    ``follows_input``: the statistics are in the data operand's dtype (so autocast resizes
    them, `cost/precision.py`); False: accumulated at a fixed width whatever it is."""

    sync_atoms: frozenset[str]
    stat_atoms: tuple[str, ...]
    nbytes: int
    collectives: tuple[tuple[str, str], ...] = (("all_reduce", "all_reduce"),)
    follows_input: bool = True


@dataclass(frozen=True)
class Signature:
    """How an op's operand dims and output dims relate (see the module docstring).

    ``kind`` is ``"contraction"`` (matmul-like: heavy, gets free strategies), ``"elementwise"``,
    ``"view"``, ``"reduction"``, ``"random"`` (a random draw: computed whole, from the same
    generator on every rank) or ``"replicated"`` (an op without a real signature: every operand
    and the output replicated).
    """

    inputs: tuple[Dims, ...]
    output: Dims
    kind: str
    unsplittable: frozenset[str] = frozenset()
    mean_atoms: frozenset[str] = frozenset()
    atom_sizes: tuple[tuple[str, int], ...] = ()
    sync: StatSync | None = None

    def size(self, atom: str) -> int:
        return dict(self.atom_sizes)[atom]

    @cached_property   # asked for per strategy and per follower: made once per signature
    def atoms(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for dims in (*self.inputs, self.output):
            for d in dims:
                seen.update(dict.fromkeys(d))
        return tuple(seen)

    @property
    def reduced_atoms(self) -> frozenset[str]:
        out = set("".join(self.output))
        return frozenset(a for a in self.atoms if a not in out)

    def splittable_atoms(self) -> tuple[str, ...]:
        """Atoms that may carry a mesh axis: not unsplittable and leading in every dim they touch."""
        ok = []
        for a in self.atoms:
            if a in self.unsplittable or dict(self.atom_sizes).get(a, 2) < 2:
                continue
            if all(d[0] == a for dims in (*self.inputs, self.output) for d in dims if a in d):
                ok.append(a)
        return tuple(ok)


def replicated_signature(num_inputs_dims: tuple[int, ...], out_ndim: int) -> Signature:
    """The signature of an op meshplan knows nothing about: all dims unsplittable."""
    letters = iter(_fresh_atoms())
    inputs = tuple(tuple(next(letters) for _ in range(n)) for n in num_inputs_dims)
    output = tuple(next(letters) for _ in range(out_ndim))
    sig = Signature(inputs, output, "replicated")
    return Signature(inputs, output, "replicated", unsplittable=frozenset(sig.atoms))


def _fresh_atoms() -> list[str]:
    # Atoms are single characters so a dim is just the concatenation of its atoms.
    return [chr(c) for c in range(0x100, 0x100 + 4096)]


def fresh_atoms(n: int, start: int = 0) -> tuple[str, ...]:
    """``n`` distinct one-character atoms (offset ``start`` keeps two sets apart)."""
    return tuple(chr(0x100 + start + i) for i in range(n))


def signature_fits(sig: Signature, in_shapes: tuple[tuple[int, ...], ...],
                   out_shape: tuple[int, ...]) -> bool:
    """Whether ``sig`` describes operands of ``in_shapes`` and an output of ``out_shape``: one
    dims entry per operand and per dim, and every dim as large as the product of its atoms."""
    if len(sig.inputs) != len(in_shapes):
        return False
    sizes = dict(sig.atom_sizes)
    for dims, shape in zip((*sig.inputs, sig.output), (*in_shapes, out_shape)):
        if len(dims) != len(shape):
            return False
        for d, n in zip(dims, shape):
            if all(a in sizes for a in d) and math.prod(sizes[a] for a in d) != n:
                return False
    return True


def canonical_text(value: object) -> str:
    """``value``'s text (a signature's, any dataclass of tuples, sets and plain values) with
    every set's members sorted, for fingerprints of program structure. A set prints in the
    order of its hash table, which depends on the order its members went in, and unpickling
    rebuilds it: a program traced ahead in a child (`capture/ahead.py`) printed other orders
    of its signatures' ``unsplittable`` atoms than the same program traced here, and its
    stages had other keys (BERT-MoE on HAP's cluster: the typed-stage search then read none
    of the uniform search's prices, session 77)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical_text(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(canonical_text(v) for v in value) + ")"
    if is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}(" + ", ".join(
            f"{f.name}={canonical_text(getattr(value, f.name))}" for f in fields(value)) + ")"
    return repr(value)
