"""Mesh-axis communicator: the collective interface a rank program talks to, and its gloo backend.

Ranks ``0..N-1`` form a 2-D logical mesh ``(r, c)``, row-major: ``rank = i*c + j``. A group is
named by mesh axes: ``(1,)`` is my row ordered by ``j``, ``(0,)`` my column ordered by ``i``,
``(0, 1)`` all ranks in rank order. Axes of size 1 are dropped; a collective whose remaining axes
are empty is the identity: it returns its input and records nothing.

The base class :class:`Comm` owns everything that does not depend on the transport: argument
checks, the record of issued collectives, and the reshaping that turns uneven shards into
equal-sized buffers (pad every shard to the largest, exchange, trim), so the emulated and the
gloo backends share it line for line. A backend implements five equal-size primitives and two
rooted ones (broadcast, reduce) on fresh contiguous buffers that nobody else references (a
backend may keep them, e.g. post them to peers); each primitive returns a fresh tensor.

Uneven all-gather and reduce-scatter come in two implementations (HAP, EuroSys'24 §2.5), chosen
by ``impl`` in :data:`IMPLS`: ``"padded"`` pads every shard to the largest and makes one
collective (cost α + n·max(s)·β); ``"broadcast"`` sends each member's shard unpadded, one
broadcast (all-gather) or one reduce to its owner (reduce-scatter) per member, n·α + Σ s·β.
Members whose piece is empty skip their round; every member knows ``sizes`` so all agree.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshplan.runtime.devices import resolve_device
from meshplan.runtime.failure import peer_errors, retire, waited
from meshplan.torch_api import all_gather_single, new_group, reduce_scatter_single

KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "resplit")
PHASES: tuple[str, ...] = ("forward", "backward", "update", "recompute")
IMPLS: tuple[str, ...] = ("padded", "broadcast")
_IMPL_KINDS = ("all_gather", "reduce_scatter")  # the kinds with a choice of implementation


class Pending:
    """A collective issued without waiting for it: ``wait()`` returns its result (once
    computed, again on later calls)."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    @classmethod
    def done(cls, result: torch.Tensor) -> Pending:
        out = cls(lambda: result)
        out.wait()
        return out

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


@dataclass(frozen=True)
class CollectiveRecord:
    """One logical collective as issued by one rank.

    ``nbytes`` is B of DESIGN.md §4, the whole tensor involved: the all-reduced tensor; the
    gathered output (real shard bytes, padding not counted); the reduce-scatter input; the sum
    over the group of the all-to-all's local inputs. ``axes`` are normalized (size-1 axes
    dropped, sorted). ``impl`` (:data:`IMPLS`) says how an all-gather or reduce-scatter was
    carried out; the other kinds are always "padded". Raises ValueError on an unknown kind,
    phase or impl, an impl other kinds lack, or a negative size.
    """

    kind: str
    nbytes: int
    axes: tuple[int, ...]
    phase: str
    impl: str = "padded"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; valid kinds: {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; valid phases: {PHASES}")
        check_impl(self.impl)
        if self.impl != "padded" and self.kind not in _IMPL_KINDS:
            raise ValueError(f"impl {self.impl!r} applies only to {_IMPL_KINDS}, not {self.kind!r}")
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")


def check_impl(impl: str) -> str:
    """Return ``impl``; ValueError naming the valid values unless it is in :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {IMPLS}")
    return impl


def check_mesh_shape(mesh_shape: Sequence[int]) -> tuple[int, int]:
    """Return ``mesh_shape`` as a ``(r, c)`` tuple; ValueError unless two positive ints."""
    shape = tuple(mesh_shape) if isinstance(mesh_shape, Sequence) else ()
    if len(shape) != 2 or not all(_is_int(s) and s >= 1 for s in shape):
        raise ValueError(f"mesh_shape must be two positive ints (r, c), got {mesh_shape!r}")
    return (int(shape[0]), int(shape[1]))


def normalize_axes(mesh_shape: tuple[int, int], axes: Sequence[int]) -> tuple[int, ...]:
    """Sorted ``axes`` with the mesh axes of size 1 dropped (``()`` means no communication).

    Raises TypeError if ``axes`` is not a sequence, ValueError on an axis outside {0, 1} or a
    repeated axis.
    """
    if isinstance(axes, (str, bytes)) or not isinstance(axes, Sequence):
        raise TypeError(f"axes must be a tuple of mesh axes from (0, 1), got {axes!r}")
    items = tuple(axes)
    if not all(_is_int(a) and a in (0, 1) for a in items) or len(set(items)) != len(items):
        raise ValueError(f"axes must be distinct mesh axes from (0, 1), got {axes!r}")
    return tuple(a for a in sorted(items) if mesh_shape[a] > 1)


def group_ranks(mesh_shape: tuple[int, int], rank: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    """Global ranks of ``rank``'s group over normalized ``axes``, in member order."""
    r, c = mesh_shape
    i, j = divmod(rank, c)
    if axes == ():
        return (rank,)
    if axes == (1,):
        return tuple(i * c + k for k in range(c))
    if axes == (0,):
        return tuple(k * c + j for k in range(r))
    return tuple(range(r * c))


def all_groups(mesh_shape: tuple[int, int]) -> dict[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Every multi-rank group of the mesh, per normalized axes, in a fixed order (rows by i,
    columns by j), so all ranks create process groups in the same order."""
    r, c = mesh_shape
    groups: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
    if c > 1:
        groups[(1,)] = tuple(group_ranks(mesh_shape, i * c, (1,)) for i in range(r))
    if r > 1:
        groups[(0,)] = tuple(group_ranks(mesh_shape, j, (0,)) for j in range(c))
    if r > 1 and c > 1:
        groups[(0, 1)] = (tuple(range(r * c)),)
    return groups


class Comm(ABC):
    """A rank's communicator over a 2-D mesh; subclasses provide the transport.

    Attributes: ``rank`` (global rank), ``mesh_shape`` ``(r, c)``, ``device`` (where the rank's
    tensors live), ``records`` (every collective issued, in order). All methods take ``phase`` in :data:`PHASES` and raise ValueError on bad
    axes, dims, sizes or phase, TypeError on a non-tensor. Sums are deterministic: every member
    gets bitwise the same result.
    """

    def __init__(self, rank: int, mesh_shape: Sequence[int],
                 device: torch.device | str = "cpu") -> None:
        self.mesh_shape = check_mesh_shape(mesh_shape)
        # Where this rank's tensors live (`runtime/devices.py`): the trainer places parameters,
        # batch pieces and scratch buffers there; collectives take their tensors' device.
        self.device = torch.device(device)
        num_ranks = self.mesh_shape[0] * self.mesh_shape[1]
        if not _is_int(rank) or not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
        self.rank = int(rank)
        self.records: list[CollectiveRecord] = []
        # Set while the forward is recomputed during backward: its collectives are recorded
        # as phase "recompute" (the plan counts them apart).
        self.recomputing = False

    def group_ranks(self, axes: Sequence[int]) -> tuple[int, ...]:
        """Global ranks of my group over ``axes``, in member order."""
        return group_ranks(self.mesh_shape, self.rank, normalize_axes(self.mesh_shape, axes))

    def group_size(self, axes: Sequence[int]) -> int:
        """Number of members of my group over ``axes`` (1 if every axis has size 1)."""
        return len(self.group_ranks(axes))

    def group_index(self, axes: Sequence[int]) -> int:
        """My position in my group over ``axes``."""
        return self.group_ranks(axes).index(self.rank)

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, phase: str,
                   scratch: bool = False) -> torch.Tensor:
        """Sum of ``t`` over the group (same shape on every member). ``scratch``: ``t`` is a
        contiguous buffer the caller gives up (a gradient bucket), which the sum may overwrite
        instead of a copy — one bucket of memory at the synchronization, not two."""
        return self.all_reduce_async(t, axes, phase=phase, scratch=scratch).wait()

    def all_reduce_async(self, t: torch.Tensor, axes: Sequence[int], *, phase: str,
                         scratch: bool = False) -> Pending:
        """`all_reduce` issued without waiting for it (recorded now); ``wait()`` gives the sum.
        Every member issues its asynchronous collectives in the same order."""
        ax = self._begin(t, axes, phase)
        if not ax:
            return Pending.done(t)
        self._record("all_reduce", _nbytes(t), ax, phase)
        if scratch and t.is_contiguous() and not t.requires_grad:
            return self._all_reduce_start(t, ax)
        return self._all_reduce_start(t.detach().clone(memory_format=torch.contiguous_format),
                                      ax)

    def all_gather(
        self, t: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int], *, phase: str,
        impl: str = "padded",
    ) -> torch.Tensor:
        """Concatenate the members' shards along ``dim``; ``sizes[m]`` is member m's length of
        ``dim`` (uneven allowed). ``impl`` (module doc): shards padded to the largest for one
        all-gather, or one unpadded broadcast per member; both give bitwise the same result."""
        return self.all_gather_async(t, axes, dim, sizes, phase=phase, impl=impl).wait()

    def all_gather_async(
        self, t: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int], *, phase: str,
        impl: str = "padded",
    ) -> Pending:
        """`all_gather` issued without waiting for it (impl "padded"; "broadcast" runs at once,
        its rounds being rooted collectives); ``wait()`` gives the whole tensor."""
        check_impl(impl)
        ax = self._begin(t, axes, phase)
        d = _check_dim(t, dim)
        sizes = self._check_sizes("sizes", sizes, ax)
        if t.shape[d] != sizes[self._index(ax)]:
            raise ValueError(
                f"all_gather: my shard has {t.shape[d]} along dim {d} but sizes says "
                f"{sizes[self._index(ax)]} (sizes={sizes})"
            )
        if not ax:
            return Pending.done(t)
        self._record("all_gather", _nbytes_along(t, d, sum(sizes)), ax, phase, impl)
        if impl == "broadcast":
            return Pending.done(self._gather_by_broadcast(t, d, sizes, ax))
        started = self._all_gather_start(_pad_along(t, d, max(sizes)), ax)

        def trim() -> torch.Tensor:
            stacked = started.wait()
            if all(s == sizes[0] for s in sizes):   # even: the stack is the concatenation
                return stacked.movedim(0, d).flatten(d, d + 1) if d else \
                    stacked.reshape(-1, *stacked.shape[2:])
            return torch.cat([stacked[m].narrow(d, 0, s) for m, s in enumerate(sizes)], dim=d)
        return Pending(trim)

    def reduce_scatter(
        self, t: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int], *, phase: str,
        impl: str = "padded",
    ) -> torch.Tensor:
        """Sum ``t`` over the group, then member m keeps the m-th piece of ``dim`` cut by
        ``sizes`` (uneven allowed; ``sum(sizes)`` must equal ``t.shape[dim]``). ``impl``
        (module doc): one padded reduce-scatter, or one unpadded reduce per member to that
        member. Each is deterministic; whether the two agree bitwise is the backend's affair
        (the emulation sums both in member order; gloo's orders may differ, see
        :class:`ProcessGroupComm`)."""
        return self.reduce_scatter_async(t, axes, dim, sizes, phase=phase, impl=impl).wait()

    def reduce_scatter_async(
        self, t: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int], *, phase: str,
        impl: str = "padded", donate: bool = False,
    ) -> Pending:
        """`reduce_scatter` issued without waiting for it (impl "padded"; "broadcast" runs at
        once); ``wait()`` gives my summed piece. ``donate``: the caller lets ``t`` go (it keeps
        no reference and writes it no more), so even pieces along dim 0 are sent from ``t``
        itself, not a copy (the transports only read their input)."""
        check_impl(impl)
        ax = self._begin(t, axes, phase)
        d = _check_dim(t, dim)
        sizes = self._check_sizes("sizes", sizes, ax)
        if sum(sizes) != t.shape[d]:
            raise ValueError(f"reduce_scatter: sizes {sizes} do not sum to {t.shape[d]} (dim {d})")
        if not ax:
            return Pending.done(t)
        self._record("reduce_scatter", _nbytes(t), ax, phase, impl)
        if impl == "broadcast":
            return Pending.done(self._scatter_by_reduce(t, d, sizes, ax))
        if d == 0 and all(s == sizes[0] for s in sizes):
            # Even pieces along dim 0 are the stack already; a copy unless donated, as the
            # transport reads it after this returns and the caller may reuse its tensor.
            src = t.detach()
            if not (donate and src.is_contiguous()):
                src = src.clone(memory_format=torch.contiguous_format)
            buf = src.view(len(sizes), *_with_size(t.shape, 0, sizes[0]))
        else:
            buf = t.new_zeros((len(sizes), *_with_size(t.shape, d, max(sizes))))
            for m, (offset, size) in enumerate(zip(_offsets(sizes), sizes)):
                buf[m].narrow(d, 0, size).copy_(t.detach().narrow(d, offset, size))
        started = self._reduce_scatter_start(buf, ax)
        me = sizes[self._index(ax)]
        return Pending(lambda: started.wait().narrow(d, 0, me).contiguous())

    def all_to_all(
        self,
        t: torch.Tensor,
        axes: Sequence[int],
        split_dim: int,
        split_sizes: Sequence[int],
        concat_dim: int,
        *,
        phase: str,
        concat_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Split ``t`` along ``split_dim`` into ``split_sizes`` (the same on every member), send
        piece m to member m, and concatenate what arrives along ``concat_dim`` in member order.

        ``concat_sizes[m]`` is member m's length of ``concat_dim``; when omitted it is exchanged
        first (one small unrecorded message), so pass it when known.
        """
        ax = self._begin(t, axes, phase)
        sd, cd = _check_dim(t, split_dim), _check_dim(t, concat_dim)
        if sd == cd:
            raise ValueError(f"all_to_all: split_dim and concat_dim must differ, both are {sd}")
        split_sizes = self._check_sizes("split_sizes", split_sizes, ax)
        if sum(split_sizes) != t.shape[sd]:
            raise ValueError(f"all_to_all: split_sizes {split_sizes} do not sum to {t.shape[sd]}")
        if concat_sizes is None:
            concat_sizes = self._gather_ints(t.shape[cd], ax) if ax else [t.shape[cd]]
        concat_sizes = self._check_sizes("concat_sizes", concat_sizes, ax)
        me = self._index(ax)
        if concat_sizes[me] != t.shape[cd]:
            raise ValueError(f"all_to_all: concat_sizes[{me}]={concat_sizes[me]} != {t.shape[cd]}")
        if not ax:
            return t
        self._record("all_to_all", _nbytes_along(t, cd, sum(concat_sizes)), ax, phase)
        pieces = torch.split(t.detach(), list(split_sizes), dim=sd)
        flat = torch.cat([p.reshape(-1) for p in pieces])
        shapes = [_with_size(_with_size(t.shape, sd, split_sizes[me]), cd, s) for s in concat_sizes]
        out_splits = [math.prod(s) for s in shapes]
        received = self._all_to_all(flat, [p.numel() for p in pieces], out_splits, ax)
        chunks = torch.split(received, out_splits)
        return torch.cat([c.view(s) for c, s in zip(chunks, shapes)], dim=cd)

    def resplit(
        self, t: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int],
        new_sizes: Sequence[int], *, phase: str,
    ) -> torch.Tensor:
        """Move the cut of ``dim`` from ``sizes`` to ``new_sizes`` (both one length per member,
        with the same sum): every member sends each other the rows of its piece that fall in
        that member's new piece, one all-to-all (HAP §5.2's re-split between model segments
        with different shard ratios). Recorded as kind "resplit" of the whole tensor."""
        ax = self._begin(t, axes, phase)
        d = _check_dim(t, dim)
        sizes = self._check_sizes("sizes", sizes, ax)
        new_sizes = self._check_sizes("new_sizes", new_sizes, ax)
        if sum(sizes) != sum(new_sizes):
            raise ValueError(f"resplit: sizes {sizes} and new_sizes {new_sizes} cut different "
                             f"lengths ({sum(sizes)} vs {sum(new_sizes)})")
        me = self._index(ax)
        if t.shape[d] != sizes[me]:
            raise ValueError(f"resplit: my piece has {t.shape[d]} along dim {d} but sizes says "
                             f"{sizes[me]} (sizes={sizes})")
        if not ax or sizes == new_sizes:
            return t
        self._record("resplit", _nbytes_along(t, d, sum(sizes)), ax, phase)
        old_at, new_at = _offsets(sizes), _offsets(new_sizes)
        row = math.prod(t.shape[:d] + t.shape[d + 1:])   # elements per index of dim

        def overlap(a: int, b: int) -> tuple[int, int]:
            """(start within a's old piece, rows) of member a's old piece in b's new one."""
            lo = max(old_at[a], new_at[b])
            hi = min(old_at[a] + sizes[a], new_at[b] + new_sizes[b])
            return (lo - old_at[a], hi - lo) if hi > lo else (0, 0)

        send = [overlap(me, m) for m in range(len(sizes))]
        flat = torch.cat([t.detach().narrow(d, s, n).reshape(-1) for s, n in send])
        came = [overlap(m, me)[1] for m in range(len(sizes))]
        received = self._all_to_all(flat, [n * row for _, n in send], [n * row for n in came], ax)
        chunks = torch.split(received, [n * row for n in came])
        return torch.cat([c.view(_with_size(t.shape, d, n)) for c, n in zip(chunks, came)], dim=d)

    # -- transport primitives: equal-size exchanges over normalized, non-empty axes ----------

    @abstractmethod
    def _all_reduce(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        """Sum of ``buf`` over the group, summed in member order."""

    @abstractmethod
    def _all_gather(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        """``(n, *buf.shape)``: every member's ``buf`` stacked in member order."""

    @abstractmethod
    def _reduce_scatter(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        """``buf`` is ``(n, *s)``; returns ``sum over members of their buf[my index]``."""

    @abstractmethod
    def _all_to_all(
        self, flat: torch.Tensor, in_splits: list[int], out_splits: list[int], axes: tuple[int, ...]
    ) -> torch.Tensor:
        """1-D exchange: chunk m of ``flat`` (``in_splits``) goes to member m; returns the chunks
        received (``out_splits`` elements from member m) concatenated in member order."""

    @abstractmethod
    def _gather_ints(self, value: int, axes: tuple[int, ...]) -> list[int]:
        """Every member's ``value`` in member order (metadata, not recorded)."""

    # -- the same, issued without waiting: a backend overlapping communication overrides them
    # (the default runs the collective at once).

    def _all_reduce_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        return Pending.done(self._all_reduce(buf, axes))

    def _all_gather_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        return Pending.done(self._all_gather(buf, axes))

    def _reduce_scatter_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        return Pending.done(self._reduce_scatter(buf, axes))

    # -- rooted primitives: every member passes a buffer of the same shape -------------------

    @abstractmethod
    def _broadcast(self, buf: torch.Tensor, src: int, axes: tuple[int, ...]) -> torch.Tensor:
        """Member ``src``'s ``buf`` on every member (``src`` is a member index, not a rank;
        the other members' ``buf`` only gives the shape)."""

    @abstractmethod
    def _reduce(self, buf: torch.Tensor, dst: int, axes: tuple[int, ...]) -> torch.Tensor | None:
        """On member ``dst``: the sum of every member's ``buf``; None on the others."""

    # -- uneven exchanges made of rooted primitives (impl="broadcast") ----------------------

    def _gather_by_broadcast(
        self, t: torch.Tensor, d: int, sizes: list[int], axes: tuple[int, ...]
    ) -> torch.Tensor:
        """One broadcast per member of its unpadded shard, concatenated in member order."""
        me, pieces = self._index(axes), []
        for m, size in enumerate(sizes):
            shape = _with_size(t.shape, d, size)
            if m == me:
                buf = t.detach().clone(memory_format=torch.contiguous_format)
            else:
                buf = t.new_empty(shape)
            pieces.append(self._broadcast(buf, m, axes) if math.prod(shape) else buf)
        return torch.cat(pieces, dim=d)

    def _scatter_by_reduce(
        self, t: torch.Tensor, d: int, sizes: list[int], axes: tuple[int, ...]
    ) -> torch.Tensor:
        """One reduce per member m of piece m of ``t``, to member m; returns my summed piece."""
        me, mine = self._index(axes), None
        for m, (offset, size) in enumerate(zip(_offsets(sizes), sizes)):
            piece = t.detach().narrow(d, offset, size).clone(memory_format=torch.contiguous_format)
            summed = self._reduce(piece, m, axes) if piece.numel() else piece
            if m == me:
                mine = summed
        assert mine is not None, "the reduce to me must return my piece"
        return mine

    # -- shared helpers --------------------------------------------------------------------

    def _begin(self, t: torch.Tensor, axes: Sequence[int], phase: str) -> tuple[int, ...]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; valid phases: {PHASES}")
        return normalize_axes(self.mesh_shape, axes)

    def _index(self, axes: tuple[int, ...]) -> int:
        return group_ranks(self.mesh_shape, self.rank, axes).index(self.rank)

    def _check_sizes(self, name: str, sizes: Sequence[int], axes: tuple[int, ...]) -> list[int]:
        n = len(group_ranks(self.mesh_shape, self.rank, axes))
        if (
            not isinstance(sizes, Sequence)
            or len(sizes) != n
            or not all(_is_int(s) and s >= 0 for s in sizes)
        ):
            raise ValueError(f"{name} must be {n} non-negative ints, one per member; got {sizes!r}")
        return [int(s) for s in sizes]

    def _record(
        self, kind: str, nbytes: int, axes: tuple[int, ...], phase: str, impl: str = "padded"
    ) -> None:
        if self.recomputing and phase == "forward":
            phase = "recompute"
        self.records.append(CollectiveRecord(kind, nbytes, axes, phase, impl))


class ProcessGroupComm(Comm):
    """:class:`Comm` over torch.distributed process groups (gloo on CPU, NCCL on CUDA; the rank's
    device is ``device``, by default the environment's, `devices.resolve_device`).

    Build it on every rank of an initialized world whose size is ``r*c``; the constructor is
    itself collective (every rank creates the same row and column groups in the same order).
    gloo has no uneven all-gather, so impl "padded" pads shards to the largest and gathers with
    ``all_gather_single``; reduce-scatter and all-to-all map to ``reduce_scatter_single`` and
    ``all_to_all_single``; the rooted primitives of impl "broadcast" to ``broadcast`` and
    ``reduce`` addressed by group rank (``group_src``/``group_dst``: a member's index is its
    rank in the axis group, not its global rank). gloo sums a reduce-scatter and a reduce in
    orders of its own (neither is member order, nor each other's): each is deterministic, but
    a reduce-scatter by "broadcast" matches "padded" to float rounding only, not bitwise
    (gathers are copies and match bitwise). Raises RuntimeError if torch.distributed is not
    initialized, ValueError if the world size differs from ``r*c``.
    """

    def __init__(self, mesh_shape: Sequence[int], device: torch.device | str | None = None
                 ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupComm needs an initialized torch.distributed world")
        shape = check_mesh_shape(mesh_shape)
        if dist.get_world_size() != shape[0] * shape[1]:
            raise ValueError(
                f"mesh_shape {shape} has {shape[0] * shape[1]} ranks but the world has "
                f"{dist.get_world_size()}"
            )
        super().__init__(dist.get_rank(), shape, resolve_device(device))
        self._make = lambda: _make_groups(shape, tuple(range(dist.get_world_size())))[self.rank]
        self._groups = self._make()
        self._host = _host_device(self.device)
        self._host_waits = self.device.type == "cpu"   # gloo: a wait blocks the host

    def rebuild(self) -> None:
        """This communicator's groups made anew in the world formed again after a failed
        step (`runtime/failure.py`). Collective, as the constructor."""
        retire(self._groups)
        self._groups = self._make()

    @classmethod
    def for_stages(cls, meshes: Sequence[tuple[Sequence[int], Sequence[int]]],
                   device: torch.device | str | None = None) -> ProcessGroupComm:
        """The communicator of this process's stage in a pipeline whose stages are
        ``(mesh_shape, global ranks)`` each: ranks numbered inside the stage, collectives over
        its own groups. Collective: every process creates every stage's groups, in stage
        order. Raises ValueError unless the stages cover the world's ranks once."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupComm needs an initialized torch.distributed world")
        stages = [(check_mesh_shape(shape), tuple(ranks)) for shape, ranks in meshes]
        flat = sorted(r for _, ranks in stages for r in ranks)
        if flat != list(range(dist.get_world_size())) or \
                any(s[0] * s[1] != len(r) for s, r in stages):
            raise ValueError(f"stage meshes {stages} must cover the world's "
                             f"{dist.get_world_size()} ranks once, each with r*c ranks")
        me = dist.get_rank()
        shape, ranks = next((s, r) for s, r in stages if me in r)

        def make() -> dict:
            mine = None
            for s, r in stages:   # every stage's groups, in stage order, on every rank
                groups = _make_groups(s, r)
                if me in r:
                    mine = groups[r.index(me)]
            return mine
        comm = cls.__new__(cls)
        Comm.__init__(comm, ranks.index(me), shape, resolve_device(device))
        comm._make = make
        comm._groups = make()
        comm._host = _host_device(comm.device)
        comm._host_waits = comm.device.type == "cpu"
        return comm

    def _all_reduce(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return self._all_reduce_start(buf, axes).wait()

    def _all_gather(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return self._all_gather_start(buf, axes).wait()

    def _reduce_scatter(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return self._reduce_scatter_start(buf, axes).wait()

    def _all_reduce_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        with peer_errors():
            work = dist.all_reduce(buf, group=self._groups[axes], async_op=True)
        return _after(work, buf, buf, self._host_waits)

    def _all_gather_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        n = self._groups[axes].size()
        out = buf.new_empty((n, *buf.shape))
        # gloo accepts only the flat "concatenation" form of all_gather_single.
        with peer_errors():
            work = all_gather_single(out.view(-1), buf.view(-1), group=self._groups[axes],
                                     async_op=True)
        return _after(work, out, buf, self._host_waits)

    def _reduce_scatter_start(self, buf: torch.Tensor, axes: tuple[int, ...]) -> Pending:
        out = buf.new_empty(buf.shape[1:])
        with peer_errors():
            work = reduce_scatter_single(out.view(-1), buf.view(-1), group=self._groups[axes],
                                         async_op=True)
        return _after(work, out, buf, self._host_waits)

    def _all_to_all(
        self, flat: torch.Tensor, in_splits: list[int], out_splits: list[int], axes: tuple[int, ...]
    ) -> torch.Tensor:
        out = flat.new_empty(sum(out_splits))
        with peer_errors():
            work = dist.all_to_all_single(out, flat, out_splits, in_splits,
                                          group=self._groups[axes], async_op=True)
        waited(work, self._host_waits)
        return out

    def _gather_ints(self, value: int, axes: tuple[int, ...]) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self._host)
        out = mine.new_empty(self._groups[axes].size())
        with peer_errors():
            work = all_gather_single(out, mine, group=self._groups[axes], async_op=True)
        waited(work, self._host.type == "cpu")
        return [int(v) for v in out.tolist()]

    def _broadcast(self, buf: torch.Tensor, src: int, axes: tuple[int, ...]) -> torch.Tensor:
        with peer_errors():
            work = dist.broadcast(buf, group=self._groups[axes], group_src=src, async_op=True)
        waited(work, self._host_waits)
        return buf

    def _reduce(self, buf: torch.Tensor, dst: int, axes: tuple[int, ...]) -> torch.Tensor | None:
        # Only dst's buffer holds the sum; gloo may leave partial sums in the others'.
        with peer_errors():
            work = dist.reduce(buf, group=self._groups[axes], group_dst=dst, async_op=True)
        waited(work, self._host_waits)
        return buf if self._index(axes) == dst else None


def _after(work: dist.Work, out: torch.Tensor, keep: torch.Tensor, host: bool) -> Pending:
    """``out`` once ``work`` is done (waited for as `failure.waited` does, on the host when
    ``host``); ``keep`` (its input) is held until then, so the buffer the transport reads
    cannot be freed under it."""
    held = [keep]

    def finish() -> torch.Tensor:
        waited(work, host)
        held.clear()
        return out
    return Pending(finish)


def _host_device(device: torch.device) -> torch.device:
    """Where small host-side exchanges (sizes) travel: the CPU when the world has a CPU backend
    (gloo, or NCCL beside gloo as `devices.backend_for` sets up), else the rank's device."""
    backend = str(dist.get_backend())
    return torch.device("cpu") if "gloo" in backend or device.type == "cpu" else device


def _make_groups(shape: tuple[int, int], ranks: tuple[int, ...]
                 ) -> dict[int, dict[tuple[int, ...], dist.ProcessGroup]]:
    """Process groups of a mesh whose position i is global rank ``ranks[i]``: per position, its
    group per axes. Collective over the whole world (`dist.new_group` is)."""
    out: dict[int, dict[tuple[int, ...], dist.ProcessGroup]] = {i: {} for i in range(len(ranks))}
    for axes, groups in all_groups(shape).items():
        for members in groups:
            glob = [ranks[i] for i in members]
            # The world group already spans every rank; making another costs connections.
            whole = glob == list(range(dist.get_world_size()))
            pg = dist.group.WORLD if whole else new_group(glob)
            for i in members:
                out[i][axes] = pg
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_dim(t: torch.Tensor, dim: int) -> int:
    if not _is_int(dim) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim {dim!r} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _with_size(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1 :])


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:m]) for m in range(len(sizes))]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nbytes_along(t: torch.Tensor, dim: int, total: int) -> int:
    """Bytes of a tensor shaped like ``t`` but with ``total`` along ``dim``."""
    return math.prod(_with_size(t.shape, dim, total)) * t.element_size()


def _pad_along(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A fresh contiguous copy of ``t`` zero-padded at the end of ``dim`` to ``size``."""
    out = t.new_zeros(_with_size(t.shape, dim, size))
    out.narrow(dim, 0, t.shape[dim]).copy_(t.detach())
    return out
