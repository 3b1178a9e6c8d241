"""How one micro-batch's program runs: at the plan's dtype, and recomputed during backward.

Mixed precision is ``torch.autocast`` around the local program (fp32 master parameters and
gradients; matmuls at the half type). Recomputation is non-reentrant
``torch.utils.checkpoint``: only the program's inputs are kept and its forward runs again inside
backward. The replay must draw the same dropout masks (the step's generator is rewound to where
the forward started) and its collectives are recorded as phase "recompute".
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshplan.cost.precision import DTYPES
from meshplan.runtime.comm import Comm


def autocast_for(dtype: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device_type`` at ``dtype`` ("bf16", "fp16"), or nothing for
    "fp32"."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown training dtype {dtype!r}; valid: {list(DTYPES)}")
    if dtype == "fp32" or device_type == "meta":   # meta: shapes only, no autocast there
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, DTYPES[dtype]))


def recomputed(program: Callable[..., torch.Tensor], args: Sequence[torch.Tensor],
               rng: torch.Generator, comm: Comm) -> torch.Tensor:
    """``program(*args)`` keeping only ``args`` for backward, which reruns the forward."""
    def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        return contextlib.nullcontext(), _replay(rng, rng.get_state(), comm)

    # The whole forward reruns, as the plan counts it: torch's early stop would end the replay
    # once the last saved tensor is back, skipping trailing collectives (a pipeline stage's
    # reduction of what it sends) that the plan lists under "recompute".
    with set_checkpoint_early_stop(False):
        return checkpoint(program, *args, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _replay(rng: torch.Generator, start: torch.Tensor, comm: Comm) -> Iterator[None]:
    now = rng.get_state()
    rng.set_state(start)
    comm.recomputing = True
    try:
        yield
    finally:
        comm.recomputing = False
        rng.set_state(now)
