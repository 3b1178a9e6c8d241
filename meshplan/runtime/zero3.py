"""ZeRO-3 parameters gathered where they are used, and nowhere else (DESIGN.md §3.5).

A ZeRO-3 parameter lives as its dim-0 shard over its data-parallel group. The local program
gathers it (`gather`) right before its first use in each forward; the gathered tensor dies
after its last use in that forward (fx frees values after their last use), and its gradient is
reduce-scattered back to the shard in backward as soon as autograd has summed it, so neither
the whole parameter nor its whole gradient outlives the ops that need them.

What autograd saves for backward would keep the gathered tensor alive through the whole step
(a matmul keeps its weight). `Rematerializer.hooks()` (``saved_tensors_hooks``) packs a saved
gathered parameter — or a view or half-precision cast of it — as a token and gathers it again
when backward unpacks it: once per parameter and backward, shared by its uses, dropped when
its gradient has been reduce-scattered. With recomputation the recomputed forward gathers
again instead (checkpointing's own hooks handle what it saves).

Collectives, recorded on the comm: per forward one all-gather ("forward", or "recompute" when
replayed); per backward one all-gather if autograd kept the parameter and one reduce-scatter.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

from meshplan.lower.local_ops import cast_float
from meshplan.runtime.comm import Comm


# How a packed tensor derives from its gathered parameter: None (it is the gathered tensor or
# a view of it), or (dtype, view): a cast to dtype of the parameter or of the view
# (size, stride, offset) of it.
Derivation = tuple[torch.dtype, tuple | None] | None


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.size()), tuple(t.stride()), t.storage_offset()


@dataclass(eq=False)
class _Gathered:
    """One forward's gathered parameter: how to gather it again, and the copies backward uses."""

    comm: Comm
    shard: torch.Tensor
    axes: tuple[int, ...]
    sizes: tuple[int, ...]
    copies: dict[Derivation, torch.Tensor] = field(default_factory=dict)

    def rebuild(self, how: Derivation) -> torch.Tensor:
        """The tensor ``how`` derives from the parameter, gathered again if this backward has
        not yet (kept until the gradient is reduce-scattered: every use unpacks before that)."""
        if how not in self.copies:
            if how is None:
                self.copies[None] = self.comm.all_gather(self.shard.detach(), self.axes, 0,
                                                         self.sizes, phase="backward")
            else:
                dtype, view = how
                whole = self.rebuild(None)
                # .to() keeps a dense input's strides, so this has the original cast's layout.
                self.copies[how] = (whole if view is None else whole.as_strided(*view)).to(dtype)
        return self.copies[how]

    def release(self) -> None:
        self.copies = {}


@dataclass(frozen=True)
class _Token:
    """A saved tensor packed away: the view ``geometry`` of what ``how`` derives from the
    gathered ``entry``."""

    entry: _Gathered
    how: Derivation
    geometry: tuple


class Rematerializer:
    """The gathered parameters of the forward in progress and the hooks that pack them (module
    docstring). One per rank; `active()` is the one whose hooks this thread has installed
    (emulated ranks are threads, and autograd's hooks are per thread too)."""

    def __init__(self) -> None:
        # id(tensor) -> (weak reference to it, its entry, how it derives from the parameter):
        # weak, so the registry never keeps a gathered tensor alive.
        self._known: dict[int, tuple[weakref.ref, _Gathered, Derivation]] = {}

    def register(self, t: torch.Tensor, entry: _Gathered, how: Derivation) -> None:
        self._known[id(t)] = (weakref.ref(t), entry, how)

    def lookup(self, t: torch.Tensor) -> tuple[_Gathered, Derivation] | None:
        hit = self._known.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1], hit[2]

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        hit = self.lookup(base)
        if hit is None:
            return t
        return _Token(hit[0], hit[1], _geometry(t))

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Token):
            return packed
        return packed.entry.rebuild(packed.how).as_strided(*packed.geometry)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Within: gathered parameters saved for backward are packed as tokens."""
        before = active()
        _ACTIVE.remat = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _ACTIVE.remat = before
            self._known.clear()


_ACTIVE = threading.local()


def active() -> Rematerializer | None:
    """The rematerializer whose hooks this thread runs under, if any."""
    return getattr(_ACTIVE, "remat", None)


def gather(comm: Comm, shard: torch.Tensor, axes: Sequence[int], sizes: Sequence[int]
           ) -> torch.Tensor:
    """The whole (local) parameter from every member's dim-0 shard (``sizes[m]`` rows); its
    gradient comes back reduce-scattered to ``shard``."""
    entry = _Gathered(comm, shard, tuple(axes), tuple(sizes))
    whole = _Gather.apply(shard, entry)
    remat = active()
    if remat is not None:
        remat.register(whole, entry, None)
    return whole


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` at ``dtype``; a cast of a gathered parameter (or of a view of it) is gathered
    again in backward too."""
    out = cast_float(x, dtype)
    remat = active()
    if remat is None or out is x:
        return out
    base = x._base if x._base is not None else x
    hit = remat.lookup(base)
    if hit is not None and hit[1] is None:
        remat.register(out, hit[0], (out.dtype, None if x is base else _geometry(x)))
    return out


class _Gather(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, shard: torch.Tensor, entry: _Gathered) -> torch.Tensor:
        ctx.entry = entry
        return entry.comm.all_gather(shard, entry.axes, 0, entry.sizes, phase="forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        entry: _Gathered = ctx.entry
        entry.release()
        piece = entry.comm.reduce_scatter(grad.contiguous(), entry.axes, 0, entry.sizes,
                                          phase="backward")
        return piece, None
