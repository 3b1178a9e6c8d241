"""A persistent pool of N local worker processes sharing one gloo process group.

Starting a rank from nothing costs the imports of torch and meshplan (6 s of CPU on this
2-core machine), so CPU workers are forked from a fork server that made those imports once
(GPU workers are spawned: `_start_context`), and tests and benchmarks start the N workers once
and send them many functions. Each worker initializes torch.distributed (gloo,
``tcp://127.0.0.1:PORT``, a short timeout so a lost peer fails a collective instead of hanging),
then loops: receive ``(fn, args)``, run ``fn(rank, nprocs, *args)``, send the result back.

Messages travel as plain pickles over one pipe per worker (not multiprocessing's pickler, which
would move tensors through shared-memory handles). The parent never blocks without a deadline:
it waits on the pipes and the process sentinels together. When a worker fails, the culprit is
chosen as: a worker that died without a message first (its death makes the others' collectives
fail), else the error raised earliest (a raise makes the peers' collectives fail later); all
workers are then stopped and :class:`~meshplan.errors.WorkerError` is raised.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from meshplan.errors import StepFailed, WorkerError
from meshplan.runtime.devices import backend_for, resolve_device
from meshplan.runtime.launch_env import DEVICE_CHOICES, DEVICE_ENV, find_free_port

_STOP_GRACE_S = 5.0  # how long close() waits for workers to leave before terminating them
_HUNG_GRACE_S = 3.0  # how long the other peers of a silent rank get to time out too


class _Failure(NamedTuple):
    """A failed worker; the smallest one (by field order) is reported as the culprit."""

    died_with_message: bool  # False first: a silent death is what breaks the peers' collectives
    when: float  # time.time() of the raise in the worker; earlier raises are causes, not effects
    rank: int
    message: str
    trace: str


class WorkerPool:
    """``nprocs`` worker processes with torch.distributed initialized once: rank r on
    ``device`` ("auto", the default: GPU r when CUDA is available, else the CPU; "cpu";
    "cuda"), NCCL beside gloo on GPUs.

    ``run(fn, *args)`` runs ``fn(rank, nprocs, *args)`` on every rank and returns the results in
    rank order; ``fn`` must be a picklable top-level function and its results picklable. Each
    worker uses one torch thread. Startup and each run must finish within ``timeout_s`` seconds
    (TimeoutError otherwise); collectives time out after ``collective_timeout_s``. If a worker
    raises or dies, every worker is stopped, the pool is closed and WorkerError is raised;
    using a closed pool raises RuntimeError. Raises ValueError on bad arguments.
    """

    def __init__(
        self, nprocs: int, *, timeout_s: float = 600.0, collective_timeout_s: float = 30.0,
        device: str | None = None,
    ) -> None:
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
            raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
        limits = {"timeout_s": timeout_s, "collective_timeout_s": collective_timeout_s}
        for name, value in limits.items():
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.nprocs = nprocs
        self.timeout_s = float(timeout_s)
        self.collective_timeout_s = float(collective_timeout_s)
        if device not in (None, *DEVICE_CHOICES):
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
        self._closed = False
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        ctx = _start_context(device)
        port = find_free_port()
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, nprocs, port, float(collective_timeout_s), device, child_end,
                      dict(os.environ)),
                name=f"meshplan-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        self._collect(time.monotonic() + self.timeout_s)  # every worker reports "ready"

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(rank, nprocs, *args)`` on every worker; results in rank order.

        ``timeout_s`` overrides the pool's timeout for this run. Raises TypeError if ``fn`` or
        ``args`` cannot be pickled, WorkerError if a worker fails, TimeoutError past the
        deadline, RuntimeError if the pool is closed.
        """
        if self._closed:
            raise RuntimeError("this WorkerPool is closed (close() was called or a worker failed)")
        try:
            task = pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(f"fn and args must be picklable (fn top-level): {exc}") from exc
        for conn in self._conns:
            try:
                conn.send_bytes(task)
            except OSError:
                pass  # that worker died; _collect reports it with its exit code
        limit = self.timeout_s if timeout_s is None else timeout_s
        return self._collect(time.monotonic() + limit)

    def close(self) -> None:
        """Ask the workers to leave, then terminate whoever is still alive. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # that worker is already gone
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._stop()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _collect(self, deadline: float) -> list[Any]:
        """One message from every worker; stops everything and raises on any failure."""
        results: list[Any] = [None] * self.nprocs
        pending = set(range(self.nprocs))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._closed = True
                self._stop()
                raise TimeoutError(f"workers {sorted(pending)} did not answer before the deadline")
            conns = [self._conns[r] for r in pending]
            sentinels = [self._procs[r].sentinel for r in pending]
            connection.wait(conns + sentinels, timeout=min(remaining, 1.0))
            failures: list[_Failure] = []
            for rank in sorted(pending):
                outcome = self._poll(rank)
                if isinstance(outcome, _Failure):
                    failures.append(outcome)
                elif outcome is not None:
                    results[rank] = outcome[0]
                    pending.discard(rank)
            if failures:
                hung = self._hung(failures, pending)
                self._closed = True
                self._stop()
                if hung is not None:
                    raise hung
                culprit = min(failures)
                raise WorkerError(culprit.rank, culprit.message, culprit.trace)
        return results

    def _hung(self, failures: list[_Failure], pending: set[int]) -> WorkerError | None:
        """When every failure so far is a peer's communication failing (timing out, or a
        connection a timed-out peer closed), the rank to blame is
        one that is still alive and silent: it stopped making progress (stuck in a loop, or in a
        collective its peers never joined). The other waiting peers time out within moments of
        each other, so they get ``_HUNG_GRACE_S`` to report first; the lowest rank still silent
        after that is named."""
        if not all(_is_comm_failure(f.message) for f in failures):
            return None
        failed = {f.rank for f in failures}
        timed_out = any(_is_timeout(f.message) for f in failures)
        deadline = time.monotonic() + _HUNG_GRACE_S
        while time.monotonic() < deadline:
            for rank in sorted(pending - failed):
                outcome = self._poll(rank)
                if isinstance(outcome, _Failure):
                    if not _is_comm_failure(outcome.message):
                        return None
                    failed.add(rank)
                    timed_out = timed_out or _is_timeout(outcome.message)
            time.sleep(0.1)
        if not timed_out:
            return None
        silent = [r for r in sorted(pending - failed) if self._procs[r].is_alive()]
        if not silent:
            return None
        first = min(failures)
        return WorkerError(silent[0], f"no progress for {self.collective_timeout_s:g} s: its "
                           f"peers timed out waiting for it (rank {first.rank}: "
                           f"{first.message})")

    def _poll(self, rank: int) -> tuple[Any] | _Failure | None:
        """``(result,)`` if rank answered, a _Failure if it failed, None if it is still busy."""
        conn, proc = self._conns[rank], self._procs[rank]
        if conn.poll():
            try:
                kind, *body = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                kind, body = "died", []
            except Exception as exc:  # noqa: BLE001 — e.g. the result's class is not importable
                message = f"its reply could not be unpickled here: {exc!r}"
                return _Failure(True, time.time(), rank, message, "")
            if kind in ("ok", "ready"):
                return (body[0] if body else None,)
            if kind == "error":
                message, trace, when, *origin = body
                return _Failure(True, when, origin[0] if origin else rank, message, trace)
        elif proc.is_alive():
            return None
        proc.join(1.0)
        return _Failure(False, 0.0, rank, _describe_exit(proc.exitcode), "")

    def _stop(self) -> None:
        """Terminate, then kill, every worker still alive; close the pipes."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self._conns:
            conn.close()


def _is_timeout(message: str) -> bool:
    return "timed out" in message.lower() or "timeout" in message.lower()


def _is_comm_failure(message: str) -> bool:
    """A peer's communication failing: a timeout, or a connection a failed peer closed."""
    text = message.lower()
    return _is_timeout(message) or "connection closed" in text or "connection reset" in text


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "process stopped answering"
    if code < 0:
        return f"process was killed by signal {-code}"
    return f"process exited with code {code} without a result"


# What the fork server imports once for every worker it forks: torch, meshplan's planner and
# runtime, and the compiler stack torch imports on a rank's first trace of its model (2.6 s of
# CPU per rank: dynamo, AOT autograd, inductor's decompositions). Imports only: the server runs
# no op, so it forks with no thread pool started. A task's own modules are imported by the
# worker that first unpickles it.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd",
            "torch._inductor.decomposition", "meshplan.api", "meshplan.runtime.pool",
            "meshplan.runtime.pipeline", "meshplan.runtime.parallel", "meshplan.zoo.spec"]


def _start_context(device: str | None) -> Any:
    """The multiprocessing context workers on ``device`` start in. On the CPU: "forkserver",
    whose server imports `_PRELOAD` once (a worker forked from it starts in milliseconds, a
    spawned one imports torch anew); each worker gets the parent's environment at start, as a
    spawned process would (`_worker_main`), not the server's. Where the workers may take GPUs:
    "spawn", as before. CUDA cannot start in a process forked from one where it was
    initialized, and whether some preloaded module queries the driver on import is a CUDA
    build's detail this machine cannot check."""
    wants = device if device is not None else os.environ.get(DEVICE_ENV) or "auto"
    if wants != "cpu" and torch.cuda.is_available():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)   # read when the server starts, once per process
    return ctx


def _worker_main(
    rank: int, nprocs: int, port: int, collective_timeout_s: float, device: str | None,
    conn: Connection, environ: dict[str, str]
) -> None:
    """Body of worker ``rank``: join the world (NCCL beside gloo on GPU ``rank``, gloo on the
    CPU), then serve tasks until told to stop."""
    os.environ.clear()   # the parent's, as at a spawn (the fork server's dates from its start)
    os.environ.update(environ)
    torch.set_num_threads(1)  # 2 cores shared by N workers
    # What torchrun would set: the ranks' own code (parallelize) finds its device from it.
    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs),
                       **({DEVICE_ENV: device} if device else {})})
    try:
        dev = resolve_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(
            backend_for(dev),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=nprocs,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        conn.send_bytes(pickle.dumps(("ready",)))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent
        _fail(conn, exc)
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except EOFError:
            os._exit(0)  # the parent is gone; nobody wants our results
        except BaseException as exc:  # noqa: BLE001 — e.g. fn not importable here
            _fail(conn, exc)
        if task is None:
            break
        fn, args = task
        try:
            reply = pickle.dumps(("ok", fn(rank, nprocs, *args)))
        except BaseException as exc:  # noqa: BLE001 — reported to the parent
            _fail(conn, exc)
        conn.send_bytes(reply)
    dist.destroy_process_group()
    # Everything was sent: skip the interpreter's teardown of torch (2-4 s a pool).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fail(conn: Connection, exc: BaseException) -> None:
    """Send the error to the parent and exit at once (peers may be stuck in a collective). A
    step that failed on every rank alike is reported as its origin's error."""
    message = f"{type(exc).__name__}: {exc}"
    trace = "".join(traceback.format_exception(exc))
    origin: tuple[int, ...] = ()
    if isinstance(exc, StepFailed) and exc.rank is not None:
        message, trace, origin = f"{exc.error_type}: {exc.message}", exc.trace, (exc.rank,)
    elif isinstance(exc, StepFailed) and exc.silent:
        message, origin = exc.summary(), (exc.silent[0],)
    try:
        conn.send_bytes(pickle.dumps(("error", message, trace, time.time(), *origin)))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
