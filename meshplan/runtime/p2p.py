"""Point-to-point transfers between global ranks: the transport of cross-mesh resharding.

``send`` does not block (the transport owns the buffer until it is delivered), ``recv`` blocks
until the matching send arrives; a (source, destination, tag) names one message, which keeps
the sender's dtype (under autocast a value crossing stages is whatever its last op made). Every message
sent is recorded (`TransferRecord`), so tests compare what crossed between meshes with the
plan. A message a rank sends itself (two virtual stages of one mesh under interleaved 1F1B)
stays in a local box and is not recorded: nothing crosses. `MailboxP2P` serves emulated ranks (threads of one process); `ProcessGroupP2P` uses
torch.distributed's send/recv (gloo on CPU, NCCL on GPU: tensors stay on their device).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TransferRecord:
    """``nbytes`` sent from global rank ``src`` to ``dst``, a message of ``kind`` (the
    sender's label: a plan's `TransferEntry` kind, or what else it is)."""

    src: int
    dst: int
    nbytes: int
    kind: str = ""


class P2P(ABC):
    """One rank's point-to-point endpoint."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.records: list[TransferRecord] = []
        self._own: defaultdict[int, deque[torch.Tensor]] = defaultdict(deque)

    def send(self, t: torch.Tensor, dst: int, tag: int, kind: str = "") -> None:
        """Post ``t`` to rank ``dst`` under ``tag`` (recorded as a message of ``kind``)."""
        buf = t.detach().contiguous().clone()
        if dst == self.rank:
            self._own[tag].append(buf)
            return
        self.records.append(TransferRecord(self.rank, dst, buf.numel() * buf.element_size(),
                                           kind))
        self._send(buf, dst, tag)

    def recv(self, shape: tuple[int, ...], src: int, tag: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """The message (src, my rank, tag), which must have ``shape``; it keeps the sender's
        dtype."""
        if src != self.rank:
            return self._recv(shape, src, tag, device)
        if not self._own[tag]:
            raise AssertionError(f"meshplan internal error: rank {self.rank} receives from "
                                 f"itself (tag {tag}) before sending")
        buf = self._own[tag].popleft()
        if tuple(buf.shape) != tuple(shape):
            raise RuntimeError(f"rank {self.rank}: sent itself {tuple(buf.shape)} (tag {tag}), "
                               f"expected {tuple(shape)}")
        return buf.to(device)

    @abstractmethod
    def _send(self, buf: torch.Tensor, dst: int, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, shape: tuple[int, ...], src: int, tag: int,
              device: torch.device | str) -> torch.Tensor: ...

    def wait_all(self) -> None:
        """Block until every send of this rank has been delivered (or handed to the network)."""


class Mailbox:
    """The messages of one emulated run; ``abort`` wakes every waiting receiver."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.aborted = threading.Event()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def abort(self) -> None:
        self.aborted.set()


class MailboxP2P(P2P):
    """Emulated ranks: a send posts the buffer to the (src, dst, tag) box of a shared mailbox."""

    def __init__(self, rank: int, mailbox: Mailbox) -> None:
        super().__init__(rank)
        self._mailbox = mailbox

    def _send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self._mailbox.box(self.rank, dst, tag).put(buf)

    def _recv(self, shape: tuple[int, ...], src: int, tag: int,
              device: torch.device | str) -> torch.Tensor:
        box, waited = self._mailbox.box(src, self.rank, tag), 0.0
        while True:   # in short waits, so a failure elsewhere ends this one quickly
            if self._mailbox.aborted.is_set():
                raise RuntimeError(f"rank {self.rank}: receive from rank {src} aborted because "
                                   "another rank failed")
            try:
                buf = box.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if waited >= self._mailbox.timeout_s:
                    raise TimeoutError(f"rank {self.rank}: no message from rank {src} (tag "
                                       f"{tag}) within {self._mailbox.timeout_s} s") from None
        if tuple(buf.shape) != tuple(shape):
            raise RuntimeError(f"rank {self.rank}: rank {src} sent {tuple(buf.shape)} (tag "
                               f"{tag}), expected {tuple(shape)}")
        return buf.to(device)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8)


class ProcessGroupP2P(P2P):
    """torch.distributed send/recv on the default group (sends asynchronous, receives
    blocking). Each message is a one-element header naming its dtype, then the data."""

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupP2P needs an initialized torch.distributed world")
        super().__init__(dist.get_rank())
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        head = torch.tensor([_DTYPES.index(buf.dtype)], dtype=torch.int64, device=buf.device)
        for t in (head, buf):
            self._pending.append((dist.isend(t, dst, tag=tag), t))

    def _recv(self, shape: tuple[int, ...], src: int, tag: int,
              device: torch.device | str) -> torch.Tensor:
        head = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(head, src, tag=tag)
        buf = torch.empty(shape, dtype=_DTYPES[int(head[0])], device=device)
        dist.recv(buf, src, tag=tag)
        return buf

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
