"""A computation run in a forked child at a low priority while this process goes on: the
planner's way of putting a core's idle cycles to work without taking the busy ones.

A search prices on every core only part of the time (its DPs, its simulations and its
bookkeeping are serial), so work it will need later (the next micro-batch count's trace,
`capture/ahead.py`; a mixed cluster's uneven program, `api._plan`) can run beside it. The
child is this process forked, so its answer is the one this process would compute; it comes
back pickled. A child that fails in a way its caller cannot re-raise, or that does not run
(starved, or stuck on a lock a thread held as the process forked), is given up, and the
caller computes the value in place.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.connection import Connection
from typing import Any, Callable

from meshplan.capture import memo

# How low the child runs. "nice": niceness 19, about 1.5 % of a normal process's weight where
# both want a core. "idle": Linux's SCHED_IDLE, below that too (a fifth of a niced process's
# weight), for work that must not slow a niced child the search waits on first.
PRIORITIES = ("nice", "idle")
NICENESS = 19
# Seconds over which a child still running, with the parent waiting for it, must have run at
# least `LEAST_SHARE` of a core (a fraction) to be waited for.
STUCK_AFTER_S = 1.0
LEAST_SHARE = 0.25
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def forks() -> bool:
    """Whether processes fork here (not on Windows, where the work is done in place)."""
    return "fork" in get_all_start_methods()


class Forked:
    """``fn()`` started in a forked child at ``priority`` (`PRIORITIES`); `outcome` collects
    it. The child's warnings are recorded and issued again here, as the call in place would
    have issued them."""

    def __init__(self, fn: Callable[[], Any], priority: str = "nice") -> None:
        assert priority in PRIORITIES, priority
        reader, writer = get_context("fork").Pipe(duplex=False)
        # Under the capture lock: no thread is tracing while the process forks, so the child
        # starts with make_fx's global patches undone and no lock held by a thread it lacks.
        with memo._LOCK:
            self.process = get_context("fork").Process(
                target=_run_into, args=(fn, priority, writer), daemon=True)
            self.process.start()
        writer.close()
        self._reader = reader

    def outcome(self) -> tuple[str, Any] | None:
        """``("ok", value)`` or ``("raised", exception)``, as ``fn()`` ended in the child; None
        where it died, its outcome would not pickle, or it stopped running (`_delivers`):
        then compute it in place. Waits for the child; ends it either way."""
        try:
            if not _delivers(self.process, self._reader):
                self.process.kill()
                return None
            kind, value, caught = pickle.loads(self._reader.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            return None   # the child died
        finally:
            self._reader.close()
            self.process.join()
        for w in caught:
            _issue(w)
        return None if kind == "failed" else (kind, value)

    def stop(self) -> None:
        """End the child unread (its answer is no longer wanted)."""
        self.process.kill()
        self.process.join()
        self._reader.close()


def value_or_in_place(forked: Forked | None, fn: Callable[[], Any]) -> Any:
    """What ``fn()`` returns or raises: ``forked``'s outcome (``fn`` run in a child), else
    ``fn()`` here."""
    got = forked.outcome() if forked is not None else None
    if got is None:
        return fn()
    kind, value = got
    if kind == "raised":
        raise value
    return value


def _issue(w: warnings.WarningMessage) -> None:
    """Issue the child's warning ``w`` as `warnings.warn` would have here: under the filters
    and once-registry of the module it names (the parent may have shown it already)."""
    module = next((m for m in list(sys.modules.values())
                   if getattr(m, "__file__", None) == w.filename), None)
    if module is None:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return
    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module.__name__,
                           vars(module).setdefault("__warningregistry__", {}))


def _delivers(child: Any, reader: Connection) -> bool:
    """Whether ``child`` has its answer ready or dies trying (then `recv_bytes` says so):
    False where, while the parent waits, it runs less than `LEAST_SHARE` of a core over
    `STUCK_AFTER_S`, and the parent computes in place: a process forked while another thread
    held a lock the work needs waits on it forever, and a low-priority child on a machine
    whose every core other work keeps busy would run at a hundredth of a core's speed."""
    last = _cpu_ticks(child.pid)
    while not reader.poll(STUCK_AFTER_S):
        if not child.is_alive():
            return True
        used = _cpu_ticks(child.pid)
        if used is None or last is None:
            return False   # its progress cannot be seen: not waited for blind
        if (used - last) / _TICKS_PER_S < LEAST_SHARE * STUCK_AFTER_S:
            return False
        last = used
    return True


def _cpu_ticks(pid: int | None) -> int | None:
    """CPU clock ticks process ``pid`` has used (Linux's /proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])   # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _lower_priority(priority: str) -> None:
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _run_into(fn: Callable[[], Any], priority: str, writer: Connection) -> None:
    """The child: ``fn()``'s value or exception, with the warnings it issued, pickled into
    ``writer``; "failed" where they do not pickle (the parent computes it again and sees)."""
    _lower_priority(priority)
    with warnings.catch_warnings(record=True) as caught:
        try:
            outcome: tuple[str, Any] = ("ok", fn())
        except BaseException as e:   # noqa: BLE001 - any failure is the caller's to report
            outcome = ("raised", e)
    try:
        out = pickle.dumps((*outcome, caught))
        pickle.loads(out)   # an exception whose constructor its args do not fit unpickles badly
    except BaseException:   # noqa: BLE001
        out = pickle.dumps(("failed", None, []))
    writer.send_bytes(out)
    writer.close()
    os._exit(0)   # no atexit handlers, no torch teardown: the parent owns those
