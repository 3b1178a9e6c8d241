"""ZeRO-3 parameters gathered where they are used, a unit at a time, ahead of their use
(DESIGN.md §3.5, §8).

A ZeRO-3 parameter lives as its dim-0 shard over its data-parallel group. The plan groups them
into units (`lower/overlap.py`: consecutive parameters of one block, as FSDP's per-block units):
a unit is gathered by one all-gather of every member's shards flattened together, its gradient
reduce-scattered by one. The local program calls `gather_unit` at the first use of any member;
`Units` (one per trainer) has by then issued that gather — ``prefetch`` units ahead, so the
next unit's gather runs while this one computes — and issues the following one. Gathered
members die after their last use in the forward (fx frees values after their last use).

What autograd saves for backward would keep a gathered member alive through the whole step (a
matmul keeps its weight). `Rematerializer.hooks()` (``saved_tensors_hooks``) packs a saved
member — or a view or half-precision cast of it — as a token, and the backward gathers its
unit again when it first unpacks one: in the plan's order (``unit_regather``: as the backward
meets them, their last forward use latest first), ``prefetch`` ahead; the copy is dropped when
the unit's gradient has been reduce-scattered. A unit's reduce-scatter is issued, without
waiting, when autograd has summed its members' gradients, in the plan's order
(``unit_scatter``), and waited for once `ZERO_SCATTERS_IN_FLIGHT` later ones are in flight
(each holds a whole gradient until then) or the backward ends (`Units.end_backward`), which
adds it to the shards' gradients. With recomputation the forward's replay gathers again instead
(checkpointing's own hooks handle what it saves).

Collectives, recorded on the comm: per forward one all-gather per unit ("forward", or
"recompute" when replayed); per backward one all-gather per unit autograd kept and one
reduce-scatter per unit.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

from meshplan.cost.memory import ZERO_SCATTERS_IN_FLIGHT
from meshplan.lower.local_ops import cast_float
from meshplan.runtime.collectives import shard_sizes
from meshplan.runtime.comm import Comm, Pending
from meshplan.runtime.grad_sync import InOrder, accumulate, settle


# How a packed tensor derives from its gathered member: None (it is the member or a view of
# it), or (dtype, view): a cast to dtype of the member or of the view (size, stride, offset).
Derivation = tuple[torch.dtype, tuple | None] | None


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.size()), tuple(t.stride()), t.storage_offset()


class Unit:
    """One unit on this rank: its members' shards (the leaves the optimizer steps) and how the
    members' dim 0 is cut over the group."""

    def __init__(self, comm: Comm, axes: Sequence[int], shards: Sequence[torch.Tensor],
                 shapes: Sequence[Sequence[int]]) -> None:
        self.comm, self.axes = comm, tuple(axes)
        self.shards = list(shards)
        self.shapes = [tuple(s) for s in shapes]
        n, self.me = comm.group_size(self.axes), comm.group_index(self.axes)
        self.rows = [shard_sizes(s[0], n) for s in self.shapes]       # [member][rank]
        self.row_numel = [math.prod(s[1:]) for s in self.shapes]
        # Each rank's flat piece: its rows of every member, member after member; ``at[i][m]``
        # where rank m's rows of member i start in the gathered whole.
        self.flat = [sum(r[m] * k for r, k in zip(self.rows, self.row_numel))
                     for m in range(n)]
        starts = _offsets(self.flat)
        self.at = [[starts[m] + sum(r[m] * q for r, q in zip(self.rows[:i], self.row_numel[:i]))
                    for m in range(n)] for i in range(len(self.shapes))]

    def gather(self, phase: str) -> Pending:
        """The unit's all-gather, issued; ``wait()`` gives the flat rank-major whole."""
        mine = torch.cat([s.detach().reshape(-1) for s in self.shards])
        return self.comm.all_gather_async(mine, self.axes, 0, self.flat, phase=phase)

    def members(self, whole: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole members from the gathered flat (rank after rank, each its rows of every
        member)."""
        return tuple(torch.cat([whole.narrow(0, at, n * k).view(n, *shape[1:])
                                for at, n in zip(starts, rows)])
                     for starts, rows, k, shape in zip(self.at, self.rows, self.row_numel,
                                                       self.shapes))

    def scatter(self, grads: Sequence[torch.Tensor | None]) -> Pending:
        """The members' gradients summed over the group, issued; ``wait()`` gives this rank's
        pieces, one per member."""
        grads = [g if g is not None else self.shards[0].new_zeros(s)
                 for g, s in zip(grads, self.shapes)]
        flat = torch.cat([g.detach().narrow(0, sum(rows[:m]), rows[m]).reshape(-1)
                          for m in range(len(self.flat))
                          for g, rows in zip(grads, self.rows)])
        started = self.comm.reduce_scatter_async(flat, self.axes, 0, self.flat,
                                                 phase="backward", donate=True)
        sizes = [rows[self.me] * k for rows, k in zip(self.rows, self.row_numel)]
        return Pending(lambda: tuple(p.view(rows[self.me], *shape[1:]) for p, rows, shape
                                     in zip(started.wait().split(sizes), self.rows,
                                            self.shapes)))


class Units:
    """The ZeRO-3 units of one trainer and the order their collectives run in (module
    docstring): ``regather`` the kept units in the backward's order, ``scatter`` every unit in
    the order its gradient completes."""

    def __init__(self, units: Sequence[Unit], regather: Sequence[int], scatter: Sequence[int],
                 prefetch: int) -> None:
        self.units = list(units)
        self.prefetch = prefetch
        self.regather = tuple(regather)
        self._at = {u: k for k, u in enumerate(self.regather)}
        self._scatter_order = tuple(scatter)
        self._scatter_at = {u: k for k, u in enumerate(self._scatter_order)}
        self._order = InOrder(len(self._scatter_order), self._launch_scatter)
        self._ahead: dict[int, Pending] = {}      # forward gathers issued, not yet used
        self._back: dict[int, Pending] = {}       # backward gathers issued, not yet used
        self._copies: dict[int, tuple[torch.Tensor, ...]] = {}
        self._derived: dict[tuple, torch.Tensor] = {}
        self._grads: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self._scattering: deque[tuple[Pending, Callable[[Any], None]]] = deque()
        self._next_back = 0
        self._backward_ran = False

    def reset(self) -> None:
        """Nothing in flight, no copy kept: after a failed step (`runtime/failure.py`)."""
        self._order.reset()
        self._ahead, self._back, self._copies, self._derived = {}, {}, {}, {}
        self._grads, self._scattering = {}, deque()
        self._next_back, self._backward_ran = 0, False

    # ---------------------------------------------------------------- forward
    def forward_members(self, u: int) -> tuple[torch.Tensor, ...]:
        """Unit ``u``'s members whole, for the forward (or its replay)."""
        phase = "forward"
        if u not in self._ahead:
            self._ahead[u] = self.units[u].gather(phase)
        # A replay inside the backward (recomputation, perhaps of one layer at a time) gathers
        # what it uses only: a unit prefetched past its layer would wait, stale, for a forward
        # that comes after the update.
        ahead = 0 if self.units[u].comm.recomputing else self.prefetch
        for v in range(u + 1, min(u + 1 + ahead, len(self.units))):
            if v not in self._ahead:
                self._ahead[v] = self.units[v].gather(phase)
        return self.units[u].members(self._ahead.pop(u).wait())

    # ---------------------------------------------------------------- backward
    def backward_member(self, u: int, i: int, how: Derivation) -> torch.Tensor:
        """Member ``i`` of unit ``u`` (as ``how`` derives from it), gathered again for the
        backward, in the plan's order, until its gradient has been reduce-scattered."""
        self._backward_ran = True
        if u not in self._copies and u not in self._at:
            raise AssertionError(f"meshplan internal error: the backward needs ZeRO-3 unit {u} "
                                 f"again, which the plan says autograd does not keep")
        if u not in self._copies:
            last = self._at[u] + self.prefetch
            while self._next_back <= min(last, len(self.regather) - 1):
                v = self.regather[self._next_back]
                self._back[v] = self.units[v].gather("backward")
                self._next_back += 1
            self._copies[u] = self.units[u].members(self._back.pop(u).wait())
        if how is None:
            return self._copies[u][i]
        key = (u, i, how)
        if key not in self._derived:
            dtype, view = how
            whole = self._copies[u][i]
            # .to() keeps a dense input's strides, so this has the original cast's layout.
            self._derived[key] = (whole if view is None else whole.as_strided(*view)).to(dtype)
        return self._derived[key]

    def gradient(self, u: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Unit ``u``'s members' gradients are complete: drop its backward copy, reduce-scatter
        it in the plan's order."""
        self._backward_ran = True
        self._copies.pop(u, None)
        self._derived = {k: v for k, v in self._derived.items() if k[0] != u}
        self._grads[u] = grads
        self._order.ready(self._scatter_at[u])

    def _launch_scatter(self, k: int) -> None:
        u = self._scatter_order[k]
        grads = self._grads.pop(u, (None,) * len(self.units[u].shards))
        shards = self.units[u].shards

        def add(pieces: tuple[torch.Tensor, ...]) -> None:
            for shard, piece in zip(shards, pieces):
                accumulate(shard, piece)
        self._scattering.append((self.units[u].scatter(grads), add))
        settle(self._scattering, ZERO_SCATTERS_IN_FLIGHT)

    def end_backward(self) -> None:
        """After a backward: every unit reduce-scattered (one that got no gradient as zeros),
        waited for and added to its shards' gradients."""
        if not self._backward_ran:
            return
        self._order.flush()
        settle(self._scattering, 0)
        for pending in self._back.values():   # kept by the plan, never unpacked: let go
            pending.wait()
        self._scattering, self._back, self._copies, self._derived = deque(), {}, {}, {}
        self._order.reset()
        self._next_back, self._backward_ran = 0, False


@dataclass(frozen=True)
class _Member:
    """Member ``index`` of unit ``unit`` of ``units``, as one forward gathered it."""

    units: Units
    unit: int
    index: int


@dataclass(frozen=True)
class _Token:
    """A saved tensor packed away: the view ``geometry`` of what ``how`` derives from the
    gathered ``member``."""

    member: _Member
    how: Derivation
    geometry: tuple


class Rematerializer:
    """The gathered members of the forward in progress and the hooks that pack them (module
    docstring). One per rank; `active()` is the one whose hooks this thread has installed
    (emulated ranks are threads, and autograd's hooks are per thread too)."""

    def __init__(self) -> None:
        # id(tensor) -> (weak reference to it, its member, how it derives from it): weak, so
        # the registry never keeps a gathered tensor alive.
        self._known: dict[int, tuple[weakref.ref, _Member, Derivation]] = {}

    def register(self, t: torch.Tensor, member: _Member, how: Derivation) -> None:
        self._known[id(t)] = (weakref.ref(t), member, how)

    def lookup(self, t: torch.Tensor) -> tuple[_Member, Derivation] | None:
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
        m = packed.member
        return m.units.backward_member(m.unit, m.index, packed.how).as_strided(
            *packed.geometry)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Within: gathered members saved for backward are packed as tokens."""
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


@contextlib.contextmanager
def running(units: Units) -> Iterator[None]:
    """Within: the local program's `gather_unit` calls gather from ``units`` (its forward,
    or the forward's replay inside the backward)."""
    before = getattr(_ACTIVE, "units", None)
    _ACTIVE.units = units
    try:
        yield
    finally:
        _ACTIVE.units = before


def gather_unit(comm: Comm, unit: int, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unit ``unit``'s members whole, from this rank's ``shards`` of them (what the local
    program calls at the unit's first use); their gradients go back reduce-scattered to the
    shards."""
    units: Units | None = getattr(_ACTIVE, "units", None)
    if units is None:
        raise AssertionError("meshplan internal error: a ZeRO-3 program ran outside its "
                             "trainer (no units to gather from)")
    members = _GatherUnit.apply(units, unit, *shards)
    remat = active()
    if remat is not None:
        for i, t in enumerate(members):
            remat.register(t, _Member(units, unit, i), None)
    return members


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` at ``dtype``; a cast of a gathered member (or of a view of it) is gathered again
    in backward too."""
    out = cast_float(x, dtype)
    remat = active()
    if remat is None or out is x:
        return out
    base = x._base if x._base is not None else x
    hit = remat.lookup(base)
    if hit is not None and hit[1] is None:
        remat.register(out, hit[0], (out.dtype, None if x is base else _geometry(x)))
    return out


class _GatherUnit(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, units: Units, unit: int, *shards: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.units, ctx.unit, ctx.count = units, unit, len(shards)
        return units.forward_members(unit)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        # The shards' gradients arrive when the reduce-scatter is waited for (end_backward).
        ctx.units.gradient(ctx.unit, grads)
        return (None, None) + (None,) * ctx.count


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:m]) for m in range(len(sizes))]
