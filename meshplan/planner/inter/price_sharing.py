"""Stage prices one search made, read by a later search of the same request.

`api.plan`'s "auto" on a cluster of several device types searches pipelines twice at the
uniform plan's micro-batch count: once with every device taken as the slowest (the uniform
search), once with stages of one device type each (the typed-stage search). The typed search's
stages on the slowest type, and those spanning types (priced as the slowest), are the uniform
search's submeshes on the same links: the same one-layer ILPs, which it solved again (BERT-MoE
on HAP's cluster, one worker: 37 of the typed search's 52 s of pricing, session 73).

Within `shared_prices()`, a stage profiler that starts pricing (`StageProfiler.prefetch`)
first takes the prices of the profilers that priced before it in the scope, wherever they
were made on the same cost context (`StageProfiler.adopt`), and is then offered to the ones
after it. Outside a scope nothing is shared or kept: a price is only as good as the
equality of everything it was made from, and a scope bounds how long the profilers (and
their formulations) live.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Per thread: requests planned at once on several threads (emulated ranks) keep apart.
_LOCAL = threading.local()


def _scope() -> list[Any] | None:
    return getattr(_LOCAL, "scope", None)


@contextmanager
def shared_prices() -> Iterator[None]:
    """A scope whose stage profilers read each other's prices (module docstring). Nested,
    the outer scope is the one shared."""
    if _scope() is not None:
        yield
        return
    _LOCAL.scope = []
    try:
        yield
    finally:
        _LOCAL.scope = None


def priced_before() -> tuple[Any, ...]:
    """The profilers that started pricing earlier in the current scope, the latest first
    (none outside a scope)."""
    return tuple(reversed(_scope() or ()))


def offer(profiler: Any) -> None:
    """Let the later profilers of the current scope read ``profiler``'s prices (nothing
    outside a scope)."""
    scope = _scope()
    if scope is not None:
        scope.append(profiler)
