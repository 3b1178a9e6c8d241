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
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Sequence

from meshplan.errors import WorkerError
from meshplan.runtime.launch_env import DEVICE_CHOICES, DEVICE_ENV, find_free_port

if TYPE_CHECKING:
    import torch

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a Ray started here waits for its runtime-env agent (Ray's own default: 30 s).
AGENT_WAIT_MS = 600_000


def init_world(timeout_s: float = 300.0, device: str | torch.device | None = None) -> bool:
    """Join the torch.distributed world of the environment (torchrun's or ``meshplan run``'s
    variables), unless one is joined already: NCCL beside gloo when this rank computes on a
    GPU (`devices.resolve_device`), gloo on the CPU. Returns whether a world is joined."""
    import torch
    import torch.distributed as dist

    from meshplan.runtime.devices import backend_for, resolve_device
    if dist.is_available() and dist.is_initialized():
        return True
    if not all(k in os.environ for k in ENV_KEYS):
        return False
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def run_script(script: str, nproc: int, args: Sequence[str] = (), *,
               poll_s: float = 0.1, device: str | None = None) -> None:
    """Run ``python script *args`` on ``nproc`` local processes joined as one world; returns
    when all exit 0. ``device`` ("auto", "cpu", "cuda"; None: each rank's default) is where
    the ranks compute: rank r on ``cuda:r`` (modulo the GPUs) when CUDA. Raises ValueError
    for a bad ``nproc`` or a missing script, WorkerError (naming the rank and its exit code)
    when a process fails; the others are then killed."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive number of processes, got {nproc!r}")
    if not os.path.isfile(script):
        raise ValueError(f"no training script {script!r}: give the path of a Python file")
    port = find_free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               **({DEVICE_ENV: device} if device else {})}
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


def _rank_main(script: str, args: list[str], env: dict[str, str]) -> None:
    """One rank inside a Ray actor: torchrun's environment, then the script as __main__."""
    import runpy
    os.environ.update(env)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _free_address() -> tuple[str, int]:
    """This node's address (as Ray sees it) and a free port on it: rank 0's rendezvous."""
    import ray
    return ray.util.get_node_ip_address(), find_free_port()


def ray_placement(device: str | None, cluster_gpus: float, nproc: int) -> tuple[int, str]:
    """(GPUs each rank's actor asks for, the device its script runs on) for a ``device`` of
    "cuda", "cpu" or "auto"/None (GPUs when the cluster has one for every rank). Raises
    ValueError when "cuda" is asked of a cluster with fewer GPUs than ranks."""
    choice = device or "auto"
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    if choice == "cuda" and cluster_gpus < nproc:
        raise ValueError(f"--device cuda on Ray needs a GPU per rank: {nproc} ranks, the "
                         f"cluster has {cluster_gpus:g} GPUs")
    if choice == "cuda" or (choice == "auto" and cluster_gpus >= nproc):
        return 1, "cuda"
    return 0, "cpu"


def run_script_on_ray(script: str, nproc: int, args: Sequence[str] = (),
                      address: str | None = None, *, poll_s: float = 0.1,
                      device: str | None = None) -> None:
    """Run ``python script *args`` as ``nproc`` ranks, one Ray actor each (one CPU, and one GPU
    when the ranks compute on GPUs: `ray_placement` of ``device``), on the cluster at
    ``address`` (None: a local Ray started here; "auto": the running one). The ranks join one
    world at rank 0's actor (gloo, NCCL beside it on GPUs). Raises ValueError for a bad
    ``nproc``, ``device`` or a missing script, ImportError naming the extra when Ray is not
    installed, WorkerError (naming the rank) when a rank fails; the others are then killed."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive number of ranks, got {nproc!r}")
    if not os.path.isfile(script):
        raise ValueError(f"no training script {script!r}: give the path of a Python file")
    try:
        import ray
    except ImportError as e:
        raise ImportError("--ray needs Ray: pip install 'meshplan[ray]'") from e
    script = os.path.abspath(script)
    started = not ray.is_initialized()
    if started:
        # A Ray started here waits minutes, not Ray's 30 s, for its runtime-env agent: on a
        # busy machine (a test suite beside it, imports on two cores) the agent comes up late
        # and the raylet otherwise exits, taking every actor with it.
        local = {} if address else {
            "num_cpus": nproc, "_system_config": {"agent_register_timeout_ms": AGENT_WAIT_MS}}
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
                 **local)
    try:
        gpus, where = ray_placement(device, ray.cluster_resources().get("GPU", 0.0), nproc)
        rank = ray.remote(num_cpus=1, num_gpus=gpus)(_Rank)
        actors = [rank.remote() for _ in range(nproc)]
        host, port = ray.get(actors[0].address.remote())
        pending = {actors[r].run.remote(script, list(args), {
            "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": host, "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", DEVICE_ENV: where}): r for r in range(nproc)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=None)
            r = pending.pop(done[0])
            try:
                ray.get(done[0])
            except Exception as e:   # the rank's own error, as Ray reports it
                for a in actors:
                    ray.kill(a)
                cause = getattr(e, "cause", None) or e
                raise WorkerError(r, f"rank {r} failed: {type(cause).__name__}: "
                                  f"{str(cause).splitlines()[0] if str(cause) else ''}; the "
                                  "others were stopped", str(e)) from None
    finally:
        if started:
            ray.shutdown()


class _Rank:
    """A Ray actor running one rank of a training script."""

    def address(self) -> tuple[str, int]:
        return _free_address()

    def run(self, script: str, args: list[str], env: dict[str, str]) -> None:
        _rank_main(script, args, env)
