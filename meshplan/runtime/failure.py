"""A step that fails on one rank fails on every rank, alike, and the world goes on.

An exception inside a step on one rank (out of memory, a user error, bad input the checks
before the step let through) leaves the other ranks waiting in a collective that rank will
never join, until the collective's timeout, with the ranks out of step for good. Gloo cannot
cancel a collective, but a process group can be aborted: its connections close and every peer
waiting on it fails at once. `StepGuard` runs the protocol, on every rank, around each step:

1. the rank that raised posts its error in the world's store (its own key) and aborts its
   process groups;
2. a peer whose collective or receive then fails (`PeerLost`, raised by the communicators)
   posts that it lost a peer and aborts its own groups: the aborts spread along the
   collectives until every rank has stopped;
3. every rank waits until all have posted, forms the world again (a fresh default group on
   the same store, under a new prefix) and rebuilds its communicators' groups (every process
   group of the process is aborted with the world: groups a user made must be made again);
4. every rank raises the same `StepFailed`: the lowest rank that raised on its own, its
   exception and traceback. If no rank had begun its update, the step is undone (gradients
   dropped, the step count restored) and the next step can run; if one had, the ranks'
   parameters may differ and the guard refuses further steps (restore a checkpoint).

A rank that never posts (its process died, or it left the training loop) is waited for up to
the world's timeout; then `StepFailed` names it and the world is not formed again. The
launchers (`meshplan.launch`, torchrun) stop a run at once when a process dies.

The protocol runs over torch.distributed's host backend; verified on gloo. Under NCCL a peer
learns of the abort only at its next host synchronization.
"""

from __future__ import annotations

import json
import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshplan.errors import StepFailed
from meshplan.torch_api import world_timeout


class PeerLost(RuntimeError):
    """A collective or receive failed because a peer left it (its group was aborted, its
    process died, or it timed out): raised by the process-group communicators."""


@contextmanager
def peer_errors() -> Iterator[None]:
    """Around a torch.distributed call: its transport's failure becomes `PeerLost`."""
    try:
        yield
    except PeerLost:
        raise
    except RuntimeError as exc:   # gloo/NCCL errors (DistBackendError is one)
        raise PeerLost(str(exc)) from exc


# How often a rank waiting on a host collective looks for a failure posted elsewhere. An
# aborted group does not wake every waiter: gloo's receives from any peer (a ring's) wait out
# their timeout, so waiting is done in slices.
_SLICE = timedelta(milliseconds=20)


def waited(work: dist.Work, host: bool = True) -> None:
    """``work.wait()``; on a host backend (gloo) in slices, raising `PeerLost` as soon as some
    rank posted a failed step. ``host`` False (NCCL: the wait only orders streams) waits
    once."""
    with peer_errors():
        if not host or _WORLD is None:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=_SLICE)
                return
            except RuntimeError as exc:
                if not str(exc).startswith("Operation timed out"):
                    raise
            if _WORLD.store.check([_WORLD.flag]):
                raise PeerLost("another rank failed its step (posted in the store)")


class ThreadWaiter:
    """Waits on point-to-point works (gloo's receives and sends): in a helper thread, while
    this one looks for a failure posted elsewhere every slice. A gloo receive cannot be waited
    on in slices (a wait that times out closes its connection) and is not woken when its peer
    aborts; a waiter that gave up is abandoned to its timeout, with its thread. The thread is a
    daemon: one left waiting never holds the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = self._start()

    @staticmethod
    def _start() -> queue.Queue:
        jobs: queue.Queue = queue.Queue()

        def serve() -> None:
            while True:
                work, done = jobs.get()
                try:
                    work.wait()
                    done.put(None)
                except BaseException as exc:   # noqa: BLE001 — handed to the waiting caller
                    done.put(exc)
        threading.Thread(target=serve, name="meshplan-p2p-wait", daemon=True).start()
        return jobs

    def wait(self, work: dist.Work, host: bool = True) -> None:
        if not host or _WORLD is None:
            with peer_errors():
                work.wait()
            return
        done: queue.Queue = queue.Queue(1)
        self._jobs.put((work, done))
        while True:
            try:
                failed = done.get(timeout=_SLICE.total_seconds())
            except queue.Empty:
                if _WORLD.store.check([_WORLD.flag]):
                    self._jobs = self._start()   # the old thread stays with its wait
                    raise PeerLost("another rank failed its step (posted in the store)")
                continue
            if failed is not None:
                with peer_errors():
                    raise failed
            return


# Process groups of an aborted world, kept: dropping the last reference runs gloo's destructor,
# which joins the group's worker threads, and one still waiting in the failed step's
# collective (a receive an abort does not wake) would hold the next step up to its timeout.
_RETIRED: list[Any] = []


def retire(*groups: Any) -> None:
    """Keep what held ``groups`` (process groups of a world aborted after a failed step)."""
    _RETIRED.extend(groups)


@dataclass
class _World:
    """The store every generation of the world is formed on, and how many times it was."""

    store: Any
    generation: int = 0

    @property
    def flag(self) -> str:
        """The key any rank failing a step of this generation sets."""
        return f"meshplan/failure/{self.generation}/any"


_WORLD: _World | None = None


def _world() -> _World:
    global _WORLD
    if _WORLD is None:
        from torch.distributed.distributed_c10d import _get_default_store
        # Kept from the first world: aborting the default group lets go of its store.
        _WORLD = _World(_get_default_store())
    return _WORLD


class StepGuard:
    """Runs steps under the protocol (module docstring). ``rebuild``: called in this order
    on every rank once the world is formed again (each communicator makes its groups anew);
    ``undo``: drops what the failed step left (gradients, pending transfers, its step count).
    Inactive (exceptions pass unchanged) where no torch.distributed world runs the step
    (emulated ranks)."""

    def __init__(self, rebuild: Sequence[Callable[[], None]], undo: Callable[[], None],
                 active: bool) -> None:
        self._rebuild, self._undo = list(rebuild), undo
        self.active = active and dist.is_available() and dist.is_initialized()
        if self.active:
            _world()
        self.updating = False
        self.step = 0
        self._depth = 0
        self._broken: StepFailed | None = None

    def begin(self, step: int) -> None:
        """Step ``step`` starts: nothing updated yet."""
        self.step, self.updating = step, False

    def check(self) -> None:
        """Raises RuntimeError once a failed step has left the ranks' parameters apart."""
        if self._broken is not None:
            raise RuntimeError(
                f"this run cannot go on: {self._broken.summary()}, after some rank had begun "
                "its update, so the ranks' parameters may differ. Restore the last "
                "checkpoint (meshplan.load_checkpoint) and run again") from self._broken

    @contextmanager
    def running(self) -> Iterator[None]:
        """One guarded part of the current step (`begin`): an exception raised in it (here
        or, through `PeerLost`, on a peer) becomes the same `StepFailed` on every rank."""
        self.check()
        self._depth += 1
        try:
            yield
        except StepFailed:
            raise
        except Exception as exc:
            if not self.active or self._depth > 1:
                raise
            raise self._fail(exc, self.step) from exc
        finally:
            self._depth -= 1

    def _fail(self, exc: Exception, step: int) -> StepFailed:
        failed = agree(exc, step, self.updating)
        if failed.world_formed:
            for rebuild in self._rebuild:
                rebuild()
        if failed.recoverable:
            self._undo()
            self.updating = False
        else:
            self._broken = failed
        return failed


def agree(exc: Exception, step: int, updating: bool) -> StepFailed:
    """Steps 1-3 of the protocol on this rank for ``exc``; the `StepFailed` every rank
    raises."""
    world = _world()
    rank, size = dist.get_rank(), dist.get_world_size()
    backend, timeout = dist.get_backend(), world_timeout() or timedelta(minutes=30)
    prefix = f"meshplan/failure/{world.generation}/"
    post = {"step": step, "lost": isinstance(exc, PeerLost), "updating": updating,
            "type": type(exc).__name__, "message": str(exc),
            "trace": "".join(traceback.format_exception(exc))}
    world.store.set(f"{prefix}{rank}", json.dumps(post))
    world.store.set(world.flag, "1")
    from torch.distributed.distributed_c10d import _abort_process_group
    _abort_process_group()
    keys = [f"{prefix}{r}" for r in range(size)]
    try:
        world.store.wait(keys, timeout)
    except RuntimeError:   # DistStoreError: some rank never posted
        silent = [r for r in range(size) if not world.store.check([keys[r]])]
        return StepFailed(rank=None, step=step, error_type="", message="", trace="",
                          recoverable=False, silent=tuple(silent),
                          waited_s=timeout.total_seconds(), world_formed=False)
    posts = [json.loads(world.store.get(k)) for k in keys]
    raised = [r for r, p in enumerate(posts) if not p["lost"]]
    origin = raised[0] if raised else min(range(size), key=lambda r: posts[r]["step"])
    world.generation += 1
    dist.init_process_group(backend, store=dist.PrefixStore(
        f"meshplan/world/{world.generation}", world.store), rank=rank, world_size=size,
        timeout=timeout)
    first = posts[origin]
    return StepFailed(rank=origin, step=first["step"], error_type=first["type"],
                      message=first["message"], trace=first["trace"],
                      recoverable=not any(p["updating"] for p in posts),
                      also=tuple(r for r in raised if r != origin), world_formed=True)
