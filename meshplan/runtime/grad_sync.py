"""Gradient synchronization buckets for the update phase (DESIGN.md §3 decision 5).

Each function issues ONE collective per dtype present (tensors are flattened into one buffer per
dtype, in order of first appearance), recorded with phase "update" and ``nbytes`` = the total
bytes of the full tensors; :func:`gather_params_into` (what ZeRO-2's update runs) cuts a dtype's
tensors into buckets of at most the largest one's bytes, to bound what it holds at once.
Replicated update: :func:`all_reduce_grads`. ZeRO: shards are dim-0
pieces with ``torch.tensor_split`` semantics over the group (member m holds
``tensor_split(p, n, dim=0)[m]``); :func:`reduce_scatter_grads` produces them from full
gradients, :func:`all_gather_params` rebuilds full tensors from them.

The bucket layout for the sharded pair is member-major: member m's pieces of every tensor are
contiguous, so a single (uneven) reduce-scatter or all-gather along the flat buffer moves them.

:class:`GradBuckets` is the overlapped form of :func:`all_reduce_grads`: the plan's buckets
all-reduced asynchronously as the step's last backward completes them (`lower/overlap.py`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshplan.lower.overlap import update_gather_buckets
from meshplan.runtime.collectives import shard_sizes
from meshplan.runtime.comm import Comm, Pending


def all_reduce_grads(comm: Comm, grads: Sequence[torch.Tensor], axes: Sequence[int]) -> None:
    """Sum every gradient over the group in place (one bucketed all-reduce per dtype).

    Raises TypeError if an entry is not a tensor, ValueError on bad axes.
    """
    grads = _check_tensors("grads", grads)
    if comm.group_size(axes) == 1:
        return
    with torch.no_grad():
        for bucket in dtype_buckets(grads):
            tensors = [grads[i] for i in bucket]
            flat = torch.cat([g.reshape(-1) for g in tensors])
            summed = comm.all_reduce(flat, axes, phase="update", scratch=True)
            for g, piece in zip(tensors, summed.split([g.numel() for g in tensors])):
                g.copy_(piece.view(g.shape))


def reduce_scatter_grads(
    comm: Comm, grads: Sequence[torch.Tensor], axes: Sequence[int]
) -> list[torch.Tensor]:
    """My dim-0 shard of each gradient summed over the group (one bucketed reduce-scatter per
    dtype); entry k has shape ``tensor_split(grads[k], n, dim=0)[my index].shape``.

    Raises TypeError if an entry is not a tensor, ValueError on a 0-dim tensor or bad axes.
    """
    grads = _check_tensors("grads", grads, need_dim0=True)
    n, me = comm.group_size(axes), comm.group_index(axes)
    out: list[torch.Tensor | None] = [None] * len(grads)
    with torch.no_grad():
        for bucket in dtype_buckets(grads):
            shards = [torch.tensor_split(grads[i].detach(), n, dim=0) for i in bucket]
            flat = torch.cat([s[m].reshape(-1) for m in range(n) for s in shards])
            sizes = [sum(s[m].numel() for s in shards) for m in range(n)]
            mine = comm.reduce_scatter(flat, axes, 0, sizes, phase="update")
            pieces = mine.split([s[me].numel() for s in shards])
            for i, s, piece in zip(bucket, shards, pieces):
                out[i] = piece.view(s[me].shape)
    return out  # type: ignore[return-value]  # every slot is filled by exactly one bucket


def all_gather_params(
    comm: Comm,
    shards: Sequence[torch.Tensor],
    full_shapes: Sequence[Sequence[int]],
    axes: Sequence[int],
) -> list[torch.Tensor]:
    """Full tensors rebuilt from every member's dim-0 shards (`gather_params_into`);
    ``full_shapes[k]`` is the full shape of tensor k.

    Raises TypeError if an entry is not a tensor, ValueError if the lists differ in length or a
    shard's shape is not my ``tensor_split`` piece of its full shape.
    """
    shards = _check_tensors("shards", shards)
    if len(full_shapes) != len(shards):
        raise ValueError(f"got {len(shards)} shards but {len(full_shapes)} full_shapes")
    n, me = comm.group_size(axes), comm.group_index(axes)
    for k, s in enumerate(shards):
        _check_shard(k, s, full_shapes[k], n, me)
    wholes = [s.new_empty(tuple(f)) for s, f in zip(shards, full_shapes)]
    gather_params_into(comm, shards, wholes, axes)
    return wholes


def gather_params_into(comm: Comm, shards: Sequence[torch.Tensor],
                       wholes: Sequence[torch.Tensor], axes: Sequence[int]) -> None:
    """Each ``wholes[k]`` overwritten with the dim-0 concatenation of every member's
    ``shards[k]``, by the buckets of `lower.overlap.update_gather_buckets` (one dtype, at most
    the largest whole tensor's bytes; one all-gather each), each copied into place before the
    next is gathered: the update holds about two of the largest tensor at once beyond the
    wholes themselves (the shards packed and the gathered bucket), not every parameter of the
    group twice over."""
    shards = _check_tensors("shards", shards)
    if len(wholes) != len(shards):
        raise ValueError(f"got {len(shards)} shards but {len(wholes)} whole tensors")
    n, me = comm.group_size(axes), comm.group_index(axes)
    rows = [_check_shard(k, s, tuple(wholes[k].shape), n, me) for k, s in enumerate(shards)]
    with torch.no_grad():
        for bucket in update_gather_buckets([s.dtype for s in shards],
                                            [w.nbytes for w in wholes]):
            row_numel = [math.prod(wholes[i].shape[1:]) for i in bucket]
            counts = [[rows[i][m] * k for i, k in zip(bucket, row_numel)] for m in range(n)]
            flat = torch.cat([shards[i].detach().reshape(-1) for i in bucket])
            whole = comm.all_gather(flat, axes, 0, [sum(c) for c in counts], phase="update")
            del flat
            for m, chunk in enumerate(whole.split([sum(c) for c in counts])):
                for i, piece in zip(bucket, chunk.split(counts[m])):
                    wholes[i].narrow(0, sum(rows[i][:m]), rows[i][m]).copy_(
                        piece.view(rows[i][m], *wholes[i].shape[1:]))


def _check_tensors(
    name: str, tensors: Sequence[torch.Tensor], *, need_dim0: bool = False
) -> list[torch.Tensor]:
    items = list(tensors)
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{k}] must be a torch.Tensor, got {type(t).__name__}")
        if need_dim0 and t.dim() == 0:
            raise ValueError(f"{name}[{k}] is 0-dim; ZeRO shards cut dim 0, so it needs >= 1 dim")
    return items


def _check_shard(k: int, shard: torch.Tensor, full: Sequence[int], n: int, me: int) -> list[int]:
    """Rows of tensor k held by each member; ValueError if ``shard`` is not my piece."""
    full = tuple(full)
    if len(full) == 0 or not all(isinstance(d, int) and d >= 0 for d in full):
        raise ValueError(f"full_shapes[{k}] must be a non-empty shape of ints >= 0, got {full!r}")
    rows = shard_sizes(full[0], n)
    expected = (rows[me], *full[1:])
    if tuple(shard.shape) != expected:
        raise ValueError(
            f"shards[{k}] has shape {tuple(shard.shape)}, but member {me} of {n} holds "
            f"{expected} of full shape {full}"
        )
    return rows


def settle(issued: deque[tuple[Pending, Callable[[Any], None]]], keep: int) -> None:
    """The oldest of the ``issued`` ZeRO reduce-scatters, ``(pending, add)`` each, waited for
    until ``keep`` are left, each result handed to its ``add`` (in issue order, so a shard sums
    its micro-batches in order). Each holds a whole gradient until it is waited for
    (`cost.memory.ZERO_SCATTERS_IN_FLIGHT`)."""
    with torch.no_grad():
        while len(issued) > keep:
            pending, add = issued.popleft()
            add(pending.wait())


def accumulate(t: torch.Tensor, piece: torch.Tensor) -> None:
    """``piece`` added to ``t``'s gradient (which it becomes when there is none)."""
    t.grad = piece if t.grad is None else t.grad.add_(piece)


def dtype_buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance."""
    buckets: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(tensors):
        buckets.setdefault(t.dtype, []).append(k)
    return list(buckets.values())


class InOrder:
    """Items launched in one fixed order, each once it is ready and every earlier one has been
    launched, so every rank issues the same collectives in the same order whatever order its
    backward completes them in."""

    def __init__(self, count: int, launch: Callable[[int], None]) -> None:
        self.count, self._launch = count, launch
        self.reset()

    def reset(self) -> None:
        self._ready: set[int] = set()
        self.next = 0

    def ready(self, k: int) -> None:
        self._ready.add(k)
        while self.next < self.count and self.next in self._ready:
            self.next += 1
            self._launch(self.next - 1)

    def flush(self) -> None:
        """Launch every item not launched yet, in order."""
        while self.next < self.count:
            self.next += 1
            self._launch(self.next - 1)


class GradBuckets:
    """Replicated gradients all-reduced in buckets while the step's last backward still runs
    (`lower/overlap.py`: the plan's buckets, in launch order).

    ``buckets``: per bucket its mesh axes and the parameters' gradient-holding tensors (leaves
    whose ``.grad`` autograd fills). Each gradient lives in its bucket, as DDP's bucket views:
    a hook on each tensor moves a gradient autograd made into the tensor's slot of a flat
    buffer (zeros until then) and makes the slot the tensor's ``.grad``, which later
    micro-batches accumulate into in place. So a bucket is all-reduced where it is, never
    flattened into a copy that doubles what the update holds (80.2 MiB measured against 72.4
    simulated on a replicated MLP pipeline when it was). Once `arm`-ed (before the step's last
    backward), a complete bucket is all-reduced asynchronously, in order; `finish` launches
    what is left (a parameter without a gradient counts as zeros), waits, and gives every
    tensor its slot of the sum as its gradient."""

    def __init__(self, comm: Comm, buckets: Sequence[tuple[tuple[int, ...],
                                                           Sequence[torch.Tensor]]]) -> None:
        self.comm = comm
        self.buckets = [(tuple(axes), list(ts)) for axes, ts in buckets]
        self._where = {id(t): (k, i) for k, (_, ts) in enumerate(self.buckets)
                       for i, t in enumerate(ts)}
        self._offsets = [[0, *itertools.accumulate(t.numel() for t in ts)]
                         for _, ts in self.buckets]
        self._order = InOrder(len(self.buckets), self._launch)
        self.reset()
        # Weakly: each tensor keeps its hook, and a strong reference back to the buckets (which
        # hold the tensors) would be a cycle through C++ that Python's collector cannot free.
        me = weakref.ref(self)

        def hook(t: torch.Tensor) -> None:
            buckets = me()
            if buckets is not None:
                buckets._hook(t)
        for _, ts in self.buckets:
            for t in ts:
                t.register_post_accumulate_grad_hook(hook)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s gradient lives in a bucket (its own slot, shared with no tensor)."""
        return id(t) in self._where

    def arm(self) -> None:
        """The next backward is the step's last: launch buckets as they fill."""
        self._armed = True

    def reset(self) -> None:
        self._armed = False
        self._order.reset()
        self._flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._seen: list[set[int]] = [set() for _ in self.buckets]
        self._pending: list[tuple[int, Pending]] = []

    def _slot(self, k: int, i: int, flat: torch.Tensor) -> torch.Tensor:
        t = self.buckets[k][1][i]
        return flat[self._offsets[k][i]:self._offsets[k][i + 1]].view(t.shape)

    def _buffer(self, k: int) -> torch.Tensor:
        if self._flat[k] is None:
            t = self.buckets[k][1][0]
            self._flat[k] = torch.zeros(self._offsets[k][-1], dtype=t.dtype, device=t.device)
        return self._flat[k]

    def _adopt(self, k: int, i: int) -> None:
        """Tensor ``i`` of bucket ``k`` given its slot as ``.grad``, a gradient it holds
        elsewhere (autograd's own tensor, the whole gradient so far) moved in first."""
        t = self.buckets[k][1][i]
        with torch.no_grad():
            slot = self._slot(k, i, self._buffer(k))
            if t.grad is not None and t.grad.data_ptr() != slot.data_ptr():
                slot.copy_(t.grad)
            t.grad = slot

    def _hook(self, t: torch.Tensor) -> None:
        k, i = self._where[id(t)]
        self._adopt(k, i)
        if self._armed:
            self._seen[k].add(i)
            if len(self._seen[k]) == len(self.buckets[k][1]):
                self._order.ready(k)

    def _launch(self, k: int) -> None:
        axes, ts = self.buckets[k]
        for i in range(len(ts)):   # those without a gradient, or given one outside a backward
            self._adopt(k, i)
        self._pending.append((k, self.comm.all_reduce_async(self._buffer(k), axes,
                                                            phase="update", scratch=True)))

    def finish(self) -> None:
        """Every bucket synchronized into its tensors' ``.grad`` (missing ones as zeros)."""
        self._order.flush()
        with torch.no_grad():
            for k, pending in self._pending:
                summed = pending.wait()
                for i, t in enumerate(self.buckets[k][1]):
                    t.grad = self._slot(k, i, summed)
        self.reset()
