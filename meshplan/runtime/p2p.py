"""Point-to-point transfers between global ranks: the transport of cross-mesh resharding.

``send`` does not block (the transport owns a copy until it is delivered), ``recv`` blocks until
the matching send arrives; a (source, destination, tag) names one message, which keeps the
sender's dtype (under autocast a value crossing stages is whatever its last op made). Every
message sent is recorded (`TransferRecord`), so tests compare what crossed between meshes with
the plan. A message a rank sends itself (two virtual stages of one mesh under interleaved 1F1B)
stays in a local box and is not recorded: nothing crosses.

Tags are meshplan's, not the transport's: NCCL ignores tags and matches a pair's sends and
receives in the order they are posted, and its send and receive between two ranks share one
stream, so a pair that both send before they receive can wait on each other forever. The
transport therefore carries, per ordered pair (source, destination), one *channel* of messages
in the order they were sent, each behind a small header (tag, dtype, size). A receiver reads its
source's channel in order and keeps what it does not want yet (``_stash``) until asked for it,
so messages may be received in any order while the transport only ever matches in order. The
two directions of a pair travel on two process groups (`ProcessGroupP2P`), so on NCCL each
direction has its own stream, where one side only sends and the other only receives: nothing
waits across directions. `MailboxP2P` serves emulated ranks (threads of one process) with the
same channels; `ProcessGroupP2P` uses torch.distributed's isend/recv (gloo on CPU, NCCL on GPU:
tensors stay on their device).
"""

from __future__ import annotations

import math
import queue
import threading
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshplan.runtime.failure import ThreadWaiter, peer_errors, retire
from meshplan.torch_api import new_group


@dataclass(frozen=True)
class TransferRecord:
    """``nbytes`` sent from global rank ``src`` to ``dst``, a message of ``kind`` (the
    sender's label: a plan's `TransferEntry` kind, or what else it is)."""

    src: int
    dst: int
    nbytes: int
    kind: str = ""


class P2P(ABC):
    """One rank's point-to-point endpoint; received tensors land on ``device``."""

    def __init__(self, rank: int, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.records: list[TransferRecord] = []
        self._own: defaultdict[int, deque[torch.Tensor]] = defaultdict(deque)
        # Messages read off a channel before they were asked for, by (source, tag).
        self._stash: defaultdict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)

    def send(self, t: torch.Tensor, dst: int, tag: int, kind: str = "") -> None:
        """Post ``t`` to rank ``dst`` under ``tag`` (recorded as a message of ``kind``)."""
        buf = t.detach().contiguous().clone()
        if dst == self.rank:
            self._own[tag].append(buf)
            return
        self.records.append(TransferRecord(self.rank, dst, buf.numel() * buf.element_size(),
                                           kind))
        self._post(buf, dst, tag)

    def recv(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        """The message (src, my rank, tag), which must have ``shape``; it keeps the sender's
        dtype and lands on this endpoint's device."""
        if src == self.rank:
            if not self._own[tag]:
                raise AssertionError(f"meshplan internal error: rank {self.rank} receives from "
                                     f"itself (tag {tag}) before sending")
            buf = self._own[tag].popleft()
        else:
            want = self._stash[(src, tag)]
            while not want:
                got, message = self._next(src)
                self._stash[(src, got)].append(message)
            buf = want.popleft()
        if buf.numel() != math.prod(shape):
            raise RuntimeError(f"rank {self.rank}: rank {src} sent {tuple(buf.shape)} (tag "
                               f"{tag}), expected {tuple(shape)}")
        return buf.reshape(shape).to(self.device)

    @abstractmethod
    def _post(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        """Append ``buf`` (a fresh contiguous tensor the transport may keep) under ``tag`` to
        the channel to ``dst``; does not wait for delivery."""

    @abstractmethod
    def _next(self, src: int) -> tuple[int, torch.Tensor]:
        """The next message of the channel from ``src``: (tag, tensor), blocking."""

    def wait_all(self) -> None:
        """Block until every send of this rank has been delivered (or handed to the network)."""


class Mailbox:
    """The channels of one emulated run; ``abort`` wakes every waiting receiver."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[tuple[int, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.aborted = threading.Event()

    def channel(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._channels.setdefault((src, dst), queue.Queue())

    def abort(self) -> None:
        self.aborted.set()


class MailboxP2P(P2P):
    """Emulated ranks: a send appends (tag, buffer) to the (src, dst) channel of a shared
    mailbox."""

    def __init__(self, rank: int, mailbox: Mailbox, device: torch.device | str = "cpu") -> None:
        super().__init__(rank, device)
        self._mailbox = mailbox

    def _post(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self._mailbox.channel(self.rank, dst).put((tag, buf))

    def _next(self, src: int) -> tuple[int, torch.Tensor]:
        channel, waited = self._mailbox.channel(src, self.rank), 0.0
        while True:   # in short waits, so a failure elsewhere ends this one quickly
            if self._mailbox.aborted.is_set():
                raise RuntimeError(f"rank {self.rank}: receive from rank {src} aborted because "
                                   "another rank failed")
            try:
                return channel.get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if waited >= self._mailbox.timeout_s:
                    raise TimeoutError(f"rank {self.rank}: no message from rank {src} within "
                                       f"{self._mailbox.timeout_s} s") from None


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8)


class ProcessGroupP2P(P2P):
    """torch.distributed isend/recv: one group carries the channels from lower to higher
    ranks, another those from higher to lower (module docstring). Each message is a header
    ``[tag, dtype, numel]`` then the data, both on the sender's device. Collective: every rank
    of the world constructs it at the same point (it creates the two groups)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        from meshplan.runtime.devices import resolve_device
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupP2P needs an initialized torch.distributed world")
        super().__init__(dist.get_rank(), resolve_device(device))
        self.rebuild()

    def rebuild(self) -> None:
        """The two groups made (again, in the world formed again after a failed step:
        `runtime/failure.py`), nothing in flight. Collective."""
        if hasattr(self, "_up"):
            retire(self._up, self._down, self._pending)
        everyone = list(range(dist.get_world_size()))
        self._up, self._down = new_group(everyone), new_group(everyone)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._own.clear()
        self._stash.clear()
        self._waiter = ThreadWaiter()

    def _group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self._up if src < dst else self._down

    def _post(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        head = torch.tensor([tag, _DTYPES.index(buf.dtype), buf.numel()], dtype=torch.int64,
                            device=buf.device)
        group = self._group(self.rank, dst)
        # Delivered ones are let go as we go: a long step posts thousands of messages.
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        with peer_errors():
            for t in (head, buf):
                self._pending.append((dist.isend(t, dst, group=group), t))

    def _next(self, src: int) -> tuple[int, torch.Tensor]:
        group = self._group(src, self.rank)
        head = torch.empty(3, dtype=torch.int64, device=self.device)
        host = self.device.type == "cpu"
        with peer_errors():
            work = dist.irecv(head, src, group=group)
        self._waiter.wait(work, host)
        tag, dtype, numel = head.tolist()
        buf = torch.empty(numel, dtype=_DTYPES[dtype], device=self.device)
        with peer_errors():
            work = dist.irecv(buf, src, group=group)
        self._waiter.wait(work, host)
        return tag, buf

    def wait_all(self) -> None:
        for work, _ in self._pending:
            self._waiter.wait(work, self.device.type == "cpu")
        self._pending.clear()

