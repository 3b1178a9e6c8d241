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

from typing import Any, Callable

from meshplan import forked
from meshplan.forked import Forked

Trace = Callable[[int], Any]   # micro-batch count -> the program's graph


class CapturesAhead:
    """``trace(count)`` memoized, with `ahead` to start a count's trace in a forked process."""

    def __init__(self, trace: Trace,
                 made_ahead: Callable[[int, Any], None] | None = None) -> None:
        """``made_ahead(count, graph)``: told of each graph a child made."""
        self._trace = trace
        self._made_ahead = made_ahead
        self._made: dict[int, tuple[Any, str]] = {}
        self._pending: dict[int, Forked] = {}

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

    def ahead(self, count: int, priority: str = "nice") -> None:
        """Start tracing ``count`` in a forked process at ``priority`` (`forked.PRIORITIES`;
        "nice" for the count a search waits on next), unless it is made or under way."""
        if count in self._made or count in self._pending or not forked.forks():
            return
        trace = self._trace
        self._pending[count] = Forked(lambda: trace(count), priority)

    def close(self) -> None:
        """Stop the traces under way (the search ended without asking for them)."""
        for child in self._pending.values():
            child.stop()
        self._pending.clear()

    def _collect(self, count: int) -> Any | None:
        """The graph a child traced for ``count``, or None when none did, or it failed (traced
        here, it fails as it would) or stalled."""
        pending = self._pending.pop(count, None)
        got = pending.outcome() if pending is not None else None
        return got[1] if got is not None and got[0] == "ok" else None
