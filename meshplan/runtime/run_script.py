"""``meshplan run SCRIPT --nproc N``: a training script on N local processes, as ``torchrun``
would start it, and the world a script joins however it was started.

Each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so one script runs unchanged under
``meshplan run``, under ``torchrun`` on several machines (c10d rendezvous) or in a single
process: `init_world` (which `meshplan.parallelize` calls) joins the world the environment
describes. When a process fails the others are stopped at once and the run fails naming it.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from typing import Sequence

import torch.distributed as dist

from meshplan.errors import WorkerError

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_world(timeout_s: float = 300.0) -> bool:
    """Join the torch.distributed world of the environment (gloo; torchrun's or ``meshplan
    run``'s variables), unless one is joined already. Returns whether a world is joined."""
    if dist.is_available() and dist.is_initialized():
        return True
    if not all(k in os.environ for k in ENV_KEYS):
        return False
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, nproc: int, args: Sequence[str] = (), *,
               poll_s: float = 0.1) -> None:
    """Run ``python script *args`` on ``nproc`` local processes joined as one world; returns
    when all exit 0. Raises ValueError for a bad ``nproc`` or a missing script, WorkerError
    (naming the rank and its exit code) when a process fails; the others are then killed."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive number of processes, got {nproc!r}")
    if not os.path.isfile(script):
        raise ValueError(f"no training script {script!r}: give the path of a Python file")
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise WorkerError(rank, f"process of rank {rank} exited with code {code}; "
                                  "the others were stopped", "")
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
