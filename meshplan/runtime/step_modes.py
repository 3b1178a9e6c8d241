"""How one micro-batch's program runs: at the plan's dtype, and recomputed during backward.

Mixed precision is ``torch.autocast`` around the local program (fp32 master parameters and
gradients; matmuls at the half type). Recomputation is non-reentrant
``torch.utils.checkpoint``: only the program's inputs are kept and its forward runs again inside
backward. The replay must draw the same dropout masks (the step's generator is rewound to where
the forward started) and its collectives are recorded as phase "recompute".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

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
def _replay(rng: torch.Generator | None, start: torch.Tensor | None, comm: Comm | None
            ) -> Iterator[None]:
    now = rng.get_state() if rng is not None else None
    if rng is not None:
        rng.set_state(start)
    if comm is not None:
        comm.recomputing = True
    try:
        yield
    finally:
        if comm is not None:
            comm.recomputing = False
        if rng is not None:
            rng.set_state(now)


def layered(gm: torch.fx.GraphModule, layer_of: Callable[[str], int],
            around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
            ) -> torch.fx.GraphModule:
    """``gm`` cut into one submodule per layer (``layer_of``: a node's layer; node names of
    ``gm``), each recomputed on its own in backward (Megatron-LM's full recomputation): a
    micro-batch keeps only what each layer receives, and the backward holds one layer's
    activations at a time, each layer's replay drawing its own dropout masks again and
    recording its collectives as "recompute". ``around()`` is entered around each layer's run
    and replay (what the program needs of its trainer, e.g. ZeRO-3's units)."""
    from torch.fx.passes.split_module import split_module
    layers = {n.name: layer_of(n.name) for n in gm.graph.nodes
              if n.op not in ("placeholder", "output")}
    # A node no IR node owns (a constant) goes with its first user.
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output") and layers[n.name] < 0:
            users = [layers[u.name] for u in n.users if u.name in layers and layers[u.name] >= 0]
            layers[n.name] = min(users, default=0)
    split = split_module(gm, None, lambda n: layers[n.name], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if name.startswith("submod_"):
            setattr(split, name, _Recomputed(sub, around))
    return split


class _Recomputed(torch.nn.Module):
    """One layer of a local program, checkpointed (`layered`)."""

    def __init__(self, layer: torch.nn.Module,
                 around: Callable[[], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.layer, self.around = layer, around

    def _run(self, *args: Any) -> Any:
        with self.around():
            return self.layer(*args)

    def forward(self, *args: Any) -> Any:
        rng = next((a for a in args if isinstance(a, torch.Generator)), None)
        comm = next((a for a in args if isinstance(a, Comm)), None)

        def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
            return contextlib.nullcontext(), _replay(rng, rng.get_state() if rng else None,
                                                     comm)

        with set_checkpoint_early_stop(False):
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=contexts)
