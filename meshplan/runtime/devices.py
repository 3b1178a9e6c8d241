"""Which device a rank computes on, and which torch.distributed backend serves it (DESIGN.md §8).

One code path for every device: a rank's device comes from the environment unless the caller
names one — ``cuda:LOCAL_RANK`` (modulo the visible GPUs) when CUDA is available, else the CPU —
and the backend follows the tensors: NCCL for CUDA tensors, gloo for CPU ones. A CUDA world is
initialized with both (``"cpu:gloo,cuda:nccl"``), so the small host-side exchanges (sizes,
metadata, DCP's planning) keep working beside NCCL's collectives. Nothing below ``runtime/``
asks which device it runs on: it is told (`lower(..., device=)`) or reads its tensors' device.
"""

from __future__ import annotations

import os

import torch

from meshplan.runtime.launch_env import DEVICE_CHOICES, DEVICE_ENV


def resolve_device(device: str | torch.device | None = None,
                   local_rank: int | None = None) -> torch.device:
    """This rank's device: ``None`` is the environment's ``MESHPLAN_DEVICE`` (set by ``meshplan
    run --device``) or else "auto"; "auto" is ``cuda:LOCAL_RANK`` when CUDA is available, else
    "cpu"; "cuda" picks ``cuda:LOCAL_RANK`` (modulo the visible GPUs); "cuda:K", "cpu",
    "meta" (shapes only, for checks) or a ``torch.device`` are taken as given. Raises
    ValueError for another name, RuntimeError when CUDA is asked for and absent."""
    if device is None:
        device = os.environ.get(DEVICE_ENV) or "auto"
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, 'cuda:K' or a "
                         f"torch.device, got {device!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked for, but this torch sees no CUDA "
                               f"device (torch {torch.__version__}); use device='cpu'")
        if dev.index is None:
            rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
            dev = torch.device("cuda", rank % torch.cuda.device_count())
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"meshplan runs on 'cpu' or 'cuda' devices (and 'meta' for checks), "
                         f"not {dev.type!r}")
    return dev


def backend_for(device: torch.device) -> str:
    """The process-group backend of a world whose ranks compute on ``device``'s type."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def generator_for(device: torch.device) -> torch.Generator:
    """A random generator on ``device`` (the step's dropout masks are drawn where they are
    used; the meta device draws nothing, a CPU generator stands in)."""
    return torch.Generator(device=device if device.type == "cuda" else "cpu")


def prepare_thread(device: torch.device) -> None:
    """Settings a thread computing on ``device`` needs: CUDA's current device, and autograd
    running backward in this thread. Emulated ranks are threads of one process, and autograd
    otherwise runs a CUDA backward on one worker thread per device: the first rank's backward
    collective would block it while the others' backwards wait behind it."""
    torch.autograd.set_multithreading_enabled(False)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def check_backend(device: torch.device) -> None:
    """RuntimeError unless the initialized world's backend can move ``device``'s tensors (a
    world joined with gloo alone cannot run NCCL collectives on GPU tensors)."""
    import torch.distributed as dist
    backend = str(dist.get_backend()).lower()
    needed = {"cuda": "nccl", "cpu": "gloo"}.get(device.type)
    if needed is not None and needed not in backend:
        raise RuntimeError(f"this rank computes on {device}, but the torch.distributed world "
                           f"was initialized with {backend!r}, which has no {needed}: "
                           f"initialize it with {backend_for(device)!r}, or pass "
                           f"device={'cpu' if device.type == 'cuda' else 'cuda'!r}")
