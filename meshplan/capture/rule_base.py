"""What a signature rule sees and returns, and the helper that sizes a signature's atoms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from meshplan.ir.signatures import Dims, Signature

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpCall:
    """What a rule sees: operand shapes (tensor args in order), output shape, all args."""

    target: str
    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    in_dtypes: tuple[str, ...] = ()
    overload: Any = None  # the aten OpOverload, for its tags

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return dict(self.kwargs).get(name, default)


@dataclass(frozen=True)
class OpRule:
    name: str
    sig: Signature
    flops: float


Rule = Callable[[OpCall], "OpRule | None"]  # None: this variant of the op has no signature


def sized(inputs: Sequence[Dims], output: Dims, shapes: Sequence[Shape], out_shape: Shape,
           kind: str, unsplittable: set[str] = frozenset(), mean: set[str] = frozenset()
           ) -> Signature:
    """A `Signature` whose atoms are sized from the shapes: a one-atom dim gives its atom's size
    (first seen wins), an atom only ever merged into larger dims gets that dim's size."""
    sizes: dict[str, int] = {}
    for dims, shape in zip((*inputs, output), (*shapes, out_shape)):
        for d, n in zip(dims, shape):
            if len(d) == 1:
                sizes.setdefault(d, n)
    for dims, shape in zip((*inputs, output), (*shapes, out_shape)):
        for d, n in zip(dims, shape):
            for a in d:
                sizes.setdefault(a, n)  # multi-atom dims: atoms sized by their own 1-atom dims
    return Signature(tuple(tuple(d) for d in inputs), tuple(output), kind,
                     frozenset(unsplittable), frozenset(mean), tuple(sizes.items()))
