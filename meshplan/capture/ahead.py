"""A program traced at each micro-batch size, the next one a search will ask for traced ahead in
a forked process while the search prices the current one.

The pipeline search walks micro-batch counts one by one (`planner/inter/search.py`), each
needing the program traced at its micro-batch size: five traces of MoE-70B, 5 s each on one
core while the other waited, the search's one serial step. Its pricing of a count keeps both
cores busy only part of the time (its DP runs, a pipeline's simulation and its whole solves'
bookkeeping are serial), so a trace made beside it costs the search little of that.

A trace made ahead is the trace this process would make (the child is this process forked, the
program's graph comes back pickled), so plans are unchanged. A child that fails, or a count
never made ahead, is traced here; one no longer wanted is stopped (`close`).
"""

from __future__ import annotations

import os
import pickle
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable

from meshplan.capture import memo

Trace = Callable[[int], Any]   # micro-batch count -> the program's graph


class CapturesAhead:
    """``trace(count)`` memoized, with `ahead` to start a count's trace in a forked process."""

    def __init__(self, trace: Trace,
                 made_ahead: Callable[[int, Any], None] | None = None) -> None:
        """``made_ahead(count, graph)``: told of each graph a child made."""
        self._trace = trace
        self._made_ahead = made_ahead
        self._made: dict[int, tuple[Any, str]] = {}
        self._pending: dict[int, tuple[BaseProcess, Connection]] = {}

    def __call__(self, count: int) -> tuple[Any, str]:
        """The program at ``count`` micro-batches and its fingerprint."""
        if count not in self._made:
            graph = self._collect(count)
            if graph is None:
                graph = self._trace(count)
            elif self._made_ahead is not None:
                self._made_ahead(count, graph)
            self._made[count] = graph, graph.fingerprint()
        return self._made[count]

    def ahead(self, count: int) -> None:
        """Start tracing ``count`` in a forked process, unless it is made or under way."""
        if count in self._made or count in self._pending or not _forks():
            return
        reader, writer = get_context("fork").Pipe(duplex=False)
        # Under the capture lock: no thread is tracing while the process forks, so the child
        # starts with make_fx's global patches undone and no lock held by a thread it lacks.
        with memo._LOCK:
            child = get_context("fork").Process(target=_trace_into, args=(self._trace, count,
                                                                         writer), daemon=True)
            child.start()
        writer.close()
        self._pending[count] = child, reader

    def close(self) -> None:
        """Stop the traces under way (the search ended without asking for them)."""
        for child, reader in self._pending.values():
            child.kill()
            child.join()
            reader.close()
        self._pending.clear()

    def _collect(self, count: int) -> Any | None:
        """The graph a child traced for ``count``, or None when none did or it failed."""
        pending = self._pending.pop(count, None)
        if pending is None:
            return None
        child, reader = pending
        try:
            if not _delivers(child, reader):
                child.kill()   # stuck: a lock some thread held as the process forked
                return None
            kind, graph = pickle.loads(reader.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            kind, graph = "failed", None   # the child died: trace here, and see why
        finally:
            reader.close()
            child.join()
        return graph if kind == "ok" else None


# The child's niceness: it takes the cycles the search leaves idle (its serial steps), not
# the pricing's turns on a busy core.
AHEAD_NICENESS = 19
# Seconds over which a child still tracing, with the parent waiting for it, must have run at
# least `LEAST_SHARE` of a core (a fraction) to be waited for.
STUCK_AFTER_S = 1.0
LEAST_SHARE = 0.25
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _delivers(child: BaseProcess, reader: Connection) -> bool:
    """Whether ``child`` has its answer ready or dies trying (then `recv_bytes` says so):
    False where, while the parent waits, it runs less than `LEAST_SHARE` of a core over
    `STUCK_AFTER_S`, and the parent traces in place: a process forked while another thread
    held a lock the trace needs waits on it forever, and a niced child on a machine whose
    every core other work keeps busy would trace at a hundredth of a core's speed."""
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


def _trace_into(trace: Trace, count: int, writer: Connection) -> None:
    """The child: ``trace(count)``'s graph, or word that it failed (the parent traces it again
    and raises what it raises)."""
    try:
        os.nice(AHEAD_NICENESS)
    except OSError:
        pass
    try:
        out = pickle.dumps(("ok", trace(count)))
    except BaseException:   # noqa: BLE001 - any failure (a graph that will not pickle too)
        out = pickle.dumps(("failed", None))   # is the parent's to report
    writer.send_bytes(out)
    writer.close()
    os._exit(0)   # no atexit handlers, no torch teardown: the parent owns those


def _forks() -> bool:
    """Whether processes fork here (not on Windows, whose planners trace in place)."""
    return "fork" in get_all_start_methods()
