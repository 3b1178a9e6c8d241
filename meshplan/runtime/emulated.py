"""N ranks emulated in one process: one thread per rank, collectives through a shared exchange.

Each group of the mesh (every row, column and the whole mesh) owns one :class:`_Exchange`: a
``threading.Barrier`` for its members and two slot lists. A member posts its payload into the
slot list of its collective's parity, waits on the barrier, then reads every member's payload.
Alternating two slot lists is enough because a member can only reuse a list after passing the
barrier of the next collective, by which time every member has finished reading this one.

Every rank's thread runs its own backward (`devices.prepare_thread`: autograd would otherwise
run a CUDA backward on one shared device thread), so backward collectives rendezvous exactly
like forward ones, on the CPU and on a GPU the ranks share. Nothing global is set: the exchange lives only for one
:func:`run_emulated` call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshplan.runtime.comm import Comm, all_groups, check_mesh_shape
from meshplan.runtime.devices import prepare_thread


class _Exchange:
    """Rendezvous of one group: a barrier and two alternating slot lists (see module doc)."""

    def __init__(self, num_members: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(num_members, timeout=timeout_s)
        self.slots: tuple[list[Any], list[Any]] = ([None] * num_members, [None] * num_members)


class _World:
    """State shared by the threads of one emulated run: exchanges and the first failure."""

    def __init__(self, mesh_shape: tuple[int, int], timeout_s: float) -> None:
        self.mesh_shape = mesh_shape
        self.timeout_s = timeout_s
        self.exchanges = {
            ranks: _Exchange(len(ranks), timeout_s)
            for groups in all_groups(mesh_shape).values()
            for ranks in groups
        }
        self._lock = threading.Lock()
        self.failure: tuple[int, BaseException] | None = None

    def fail(self, rank: int, exc: BaseException) -> None:
        """Keep the first failure and break every barrier so the other ranks stop waiting."""
        with self._lock:
            if self.failure is None:
                self.failure = (rank, exc)
        for exchange in self.exchanges.values():
            exchange.barrier.abort()


class _PeerFailed(RuntimeError):
    """Raised in a rank whose collective was aborted because another rank failed first."""


class EmulatedComm(Comm):
    """:class:`Comm` for one emulated rank; built by :func:`run_emulated`, not by users.

    Besides the Comm checks, every collective verifies that all members issued the same kind
    with matching shapes, and raises RuntimeError naming the mismatch otherwise (a bug in the
    rank programs that a real backend would turn into a hang or garbage).
    """

    def __init__(self, rank: int, mesh_shape: Sequence[int], world: _World,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(rank, mesh_shape, device)
        self._world = world
        self._seq: dict[tuple[int, ...], int] = {}

    def _all_reduce(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        posted = self._rendezvous("all_reduce", axes, buf)
        _check_same_shape("all_reduce", posted)
        return _sum_in_order(posted)

    def _all_gather(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        posted = self._rendezvous("all_gather", axes, buf)
        _check_same_shape("all_gather", posted)
        return torch.stack(posted)

    def _reduce_scatter(self, buf: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        posted = self._rendezvous("reduce_scatter", axes, buf)
        _check_same_shape("reduce_scatter", posted)
        me = self._index(axes)
        return _sum_in_order([p[me] for p in posted])

    def _all_to_all(
        self, flat: torch.Tensor, in_splits: list[int], out_splits: list[int], axes: tuple[int, ...]
    ) -> torch.Tensor:
        posted = self._rendezvous("all_to_all", axes, (flat, in_splits))
        me = self._index(axes)
        pieces = []
        for m, (their_flat, their_splits) in enumerate(posted):
            if their_splits[me] != out_splits[m]:
                raise RuntimeError(
                    f"all_to_all: member {m} sends {their_splits[me]} elements to member {me}, "
                    f"which expects {out_splits[m]} (split or concat sizes disagree across ranks)"
                )
            pieces.append(their_flat.narrow(0, sum(their_splits[:me]), their_splits[me]))
        return torch.cat(pieces)

    def _gather_ints(self, value: int, axes: tuple[int, ...]) -> list[int]:
        return list(self._rendezvous("gather_ints", axes, value))

    def _broadcast(self, buf: torch.Tensor, src: int, axes: tuple[int, ...]) -> torch.Tensor:
        # A copy even on the root: a posted buffer is read by peers after the barrier, so it
        # must not be handed back to a caller who might write to it.
        return self._rooted("broadcast", axes, src, buf)[src].clone()

    def _reduce(self, buf: torch.Tensor, dst: int, axes: tuple[int, ...]) -> torch.Tensor | None:
        bufs = self._rooted("reduce", axes, dst, buf)
        return _sum_in_order(bufs) if self._index(axes) == dst else None

    def _rooted(self, kind: str, axes: tuple[int, ...], root: int, buf: torch.Tensor
                ) -> list[torch.Tensor]:
        """Every member's ``buf`` of a broadcast or reduce, after checking that all members
        named the same root and passed the same shape."""
        posted = self._rendezvous(kind, axes, (root, buf))
        roots = [r for r, _ in posted]
        if len(set(roots)) > 1:
            raise RuntimeError(f"{kind}: members named different roots {roots}")
        bufs = [b for _, b in posted]
        _check_same_shape(kind, bufs)
        return bufs

    def _rendezvous(self, kind: str, axes: tuple[int, ...], payload: Any) -> list[Any]:
        """Post ``payload``, wait for the whole group, return every member's payload in order."""
        ranks = self.group_ranks(axes)
        exchange = self._world.exchanges[ranks]
        seq = self._seq.get(ranks, 0)
        self._seq[ranks] = seq + 1
        slots = exchange.slots[seq % 2]
        slots[ranks.index(self.rank)] = (kind, payload)
        try:
            exchange.barrier.wait()
        except threading.BrokenBarrierError:
            raise self._broken(kind, ranks) from None
        posted = list(slots)
        kinds = [k for k, _ in posted]
        if len(set(kinds)) > 1:
            raise RuntimeError(f"collective mismatch in group {ranks}: members issued {kinds}")
        return [p for _, p in posted]

    def _broken(self, kind: str, ranks: tuple[int, ...]) -> Exception:
        if self._world.failure is not None:
            return _PeerFailed(f"rank {self.rank}: {kind} aborted because another rank failed")
        return TimeoutError(
            f"rank {self.rank}: {kind} in group {ranks} timed out after "
            f"{self._world.timeout_s} s waiting for the other members"
        )


def run_emulated(
    fn: Callable[..., Any], mesh_shape: Sequence[int], *args: Any, timeout_s: float = 30.0,
    device: torch.device | str = "cpu",
) -> list[Any]:
    """Run ``fn(comm, *args)`` for every rank of ``mesh_shape``, each in its own thread; every
    rank computes on ``device`` (``comm.device``; several ranks may share one GPU).

    Returns the results in rank order. If a rank raises, the barriers are broken so the others
    fail fast, and the first rank's exception is re-raised with a note naming the rank. A
    collective that waits more than ``timeout_s`` seconds raises TimeoutError. Raises ValueError
    on a bad ``mesh_shape`` or ``timeout_s``.
    """
    shape = check_mesh_shape(mesh_shape)
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    world = _World(shape, float(timeout_s))
    num_ranks = shape[0] * shape[1]
    results: list[Any] = [None] * num_ranks
    dev = torch.device(device)

    def body(rank: int) -> None:
        try:
            prepare_thread(dev)
            results[rank] = fn(EmulatedComm(rank, shape, world, dev), *args)
        except BaseException as exc:  # noqa: BLE001 — re-raised in the caller's thread
            world.fail(rank, exc)

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"meshplan-rank{rank}", daemon=True)
        for rank in range(num_ranks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if world.failure is not None:
        rank, exc = world.failure
        exc.add_note(f"raised on emulated rank {rank} of mesh {shape}")
        raise exc
    return results


def run_emulated_stages(
    fn: Callable[..., Any], meshes: Sequence[tuple[Sequence[int], Sequence[int]]], *args: Any,
    timeout_s: float = 30.0, device: torch.device | str = "cpu"
) -> list[Any]:
    """Run ``fn(comm, p2p, *args)`` for every global rank of a pipeline's stage meshes, each in
    its own thread: ``meshes`` lists per stage its ``(mesh_shape, global ranks)``; ``comm`` is
    the rank's communicator inside its stage (ranks numbered in the stage), ``p2p`` its
    point-to-point endpoint between global ranks. Results in global rank order; the first
    failure stops every rank and is re-raised with a note naming its rank, as `run_emulated`.
    Raises ValueError unless the stages' ranks are 0..N-1 exactly once. Every rank computes on
    ``device``."""
    from meshplan.runtime.p2p import Mailbox, MailboxP2P
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    shapes = [check_mesh_shape(shape) for shape, _ in meshes]
    ranks = [tuple(r) for _, r in meshes]
    flat = sorted(r for rs in ranks for r in rs)
    if flat != list(range(len(flat))) or any(s[0] * s[1] != len(r) for s, r in zip(shapes, ranks)):
        raise ValueError(f"stage meshes {list(zip(shapes, ranks))} must cover ranks "
                         f"0..{len(flat) - 1} once, each with mesh_shape[0] * mesh_shape[1] ranks")
    worlds = [_World(shape, float(timeout_s)) for shape in shapes]
    mailbox = Mailbox(float(timeout_s))
    lock = threading.Lock()
    failure: list[tuple[int, BaseException]] = []
    results: list[Any] = [None] * len(flat)
    dev = torch.device(device)

    def body(stage: int, local: int, rank: int) -> None:
        try:
            prepare_thread(dev)
            results[rank] = fn(EmulatedComm(local, shapes[stage], worlds[stage], dev),
                               MailboxP2P(rank, mailbox, dev), *args)
        except BaseException as exc:  # noqa: BLE001 — re-raised in the caller's thread
            with lock:
                failure.append((rank, exc))
            mailbox.abort()
            for w in worlds:
                w.fail(rank, exc)

    threads = [threading.Thread(target=body, args=(s, i, r), name=f"meshplan-rank{r}",
                                daemon=True)
               for s, rs in enumerate(ranks) for i, r in enumerate(rs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failure:
        rank, exc = failure[0]
        exc.add_note(f"raised on emulated rank {rank} of a {len(ranks)}-stage pipeline")
        raise exc
    return results


def _check_same_shape(kind: str, posted: list[torch.Tensor]) -> None:
    shapes = [(tuple(p.shape), p.dtype) for p in posted]
    if len(set(shapes)) > 1:
        raise RuntimeError(f"{kind}: members posted different shapes/dtypes {shapes}")


def _sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in member order, so every member computes bitwise the same result."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total
