"""A step's half-type copies of its parameters, made once and used by every micro-batch.

Under mixed precision the local program casts each fp32 operand of a contraction to the half
type where it uses it (`lower/program.py`). For a parameter that cast is the same in every
micro-batch of a step, so the first micro-batch's is kept and the later ones use it again, as
Megatron-LM keeps half copies of its weights: a step of M micro-batches reads and writes the
weights' casts once instead of M times, and the micro-batches a pipeline keeps in flight share
one copy instead of saving one each. Gradients are unchanged: each micro-batch's backward still
passes through the cast (whose backward saves nothing, so it may run once per micro-batch) and
accumulates into the fp32 parameter, as before.

Recomputation's replays use them too. A plan made without them
(`IntraOptions.hold_half_copies`, where they did not fit) keeps none: every micro-batch and
replay casts again, and a layer's copies live only while it runs (the trainer gives no
parameters). Only casts of the step's parameters, or of views of them, are kept, and only
while autograd records (a cast made without it would carry no gradient to the parameter). A
parameter changed in place (the update) has a new version, so its old cast is never used
again; `clear` frees them all between steps.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch

_ACTIVE: contextvars.ContextVar["StepCasts | None"] = contextvars.ContextVar("step_casts",
                                                                             default=None)


class StepCasts:
    """The casts of ``params`` (the tensors a rank's program takes as parameters) made during
    one step (module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = {id(p): p for p in params}
        self._made: dict[tuple, torch.Tensor] = {}

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """``x`` at ``dtype``, the step's kept copy where ``x`` is a parameter or a view of
        one; None where it is not (the caller casts)."""
        base = x._base if x._base is not None else x
        if id(base) not in self._params or not torch.is_grad_enabled():
            return None
        key = (id(base), base._version, x.storage_offset(), tuple(x.shape), x.stride(), dtype)
        out = self._made.get(key)
        if out is None:
            out = self._made[key] = x.to(dtype)
        return out

    def clear(self) -> None:
        self._made.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the program's casts of parameters go through this step's copies."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def active() -> StepCasts | None:
    """The step casts in use where the program runs, if any."""
    return _ACTIVE.get()
