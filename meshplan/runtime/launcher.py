"""Local launcher: run one function on N freshly spawned processes joined by gloo.

This is the embedded default of DESIGN.md §3 decision 11 (beyond one machine the same rank
programs run under torchrun or Ray). It is a one-shot :class:`~meshplan.runtime.pool.WorkerPool`:
spawn, initialize torch.distributed, run, stop — with the pool's failure semantics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from meshplan.runtime.pool import WorkerPool


def launch(
    fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float = 600.0,
    collective_timeout_s: float = 30.0, device: str | None = None
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` spawned processes; results in rank order.

    Each process uses one torch thread and joins one world over a free loopback port: rank r
    computes on ``device`` ("auto", the default: GPU r when CUDA is available, with NCCL beside
    gloo; "cpu": gloo; "cuda").
    ``fn`` must be a picklable top-level function and its result picklable. If a rank raises or
    its process dies, the others are stopped and :class:`~meshplan.errors.WorkerError` (rank,
    message, traceback) is raised; TimeoutError if the whole run exceeds ``timeout_s`` seconds;
    ValueError on a bad ``nprocs`` or ``timeout_s``; TypeError if ``fn``/``args`` can't be pickled.
    A collective or point-to-point receive waiting ``collective_timeout_s`` seconds for a peer
    fails; when only such timeouts fail while a rank stays silent, that rank is named ("no
    progress for N s").
    """
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    start = time.monotonic()
    with WorkerPool(nprocs, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                    device=device) as pool:
        remaining = timeout_s - (time.monotonic() - start)
        return pool.run(fn, *tuple(args), timeout_s=max(remaining, 1e-3))
