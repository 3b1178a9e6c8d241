"""Explain a trace that torch refused: which aten op, in which module, and what to do instead.

make_fx runs the model on fake tensors, which carry shapes but no data. Ops whose output shape
depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``) cannot be
traced that way, and some kernels only accept other dtypes or devices under fake tensors
(``_grouped_mm``). torch reports those deep inside its dispatcher; this module turns them into one
ValueError a user can act on.
"""

from __future__ import annotations

import types
import torch
from torch import nn
from torch._subclasses import fake_tensor

_DATA_DEPENDENT = (fake_tensor.DynamicOutputShapeException,
                   fake_tensor.DataDependentOutputException)


def _failing_op(exc: BaseException) -> str | None:
    """The aten op torch was running: named by the exception, else found in its traceback."""
    func = getattr(exc, "func", None)
    if func is None:
        for frame in _frames(exc):
            cand = frame.f_locals.get("func")
            if isinstance(cand, torch._ops.OpOverload):
                func = cand  # keep the innermost
    return None if func is None else str(func).removeprefix("aten.")


def _failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The qualified name of the innermost module whose forward was running."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    for frame in _frames(exc):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, nn.Module) \
                and id(owner) in names:
            found = names[id(owner)] or f"the model ({type(owner).__name__})"
            if names[id(owner)]:
                found = f"{found} ({type(owner).__name__})"
    return found


def _frames(exc: BaseException) -> list[types.FrameType]:
    out: list[types.FrameType] = []
    tb = exc.__traceback__
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _is_data_dependent(exc: BaseException) -> bool:
    if isinstance(exc, _DATA_DEPENDENT):
        return True
    # Symbolic-shape guards on data (``if mask.any():``) surface under this name.
    return type(exc).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


def explain_trace_failure(exc: BaseException, model: nn.Module) -> ValueError:
    """A ValueError naming the op and module torch failed on, with a remedy when one is known."""
    op = _failing_op(exc)
    module = _failing_module(exc, model)
    where = f"aten op '{op}'" if op else "an op"
    if module:
        where += f" in module {module}"
    if _is_data_dependent(exc):
        return ValueError(
            f"meshplan cannot trace {where}: its output shape depends on the values of its "
            "input (nonzero, boolean-mask indexing, unique, masked_select, dropless MoE routing"
            "), and a plan needs every shape before training. Use a static shape instead: "
            "e.g. a capacity-based MoE (fixed slots per expert, as meshplan.zoo.moe_layer), "
            "torch.where / multiplying by a mask instead of indexing with it, or padding to a "
            "fixed size.")
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(
        f"meshplan cannot trace {where} on fake tensors (shapes without data, CPU): {detail}. "
        "If the op only supports other dtypes or devices (e.g. _grouped_mm), use its plain "
        "equivalent (a loop or einsum over the groups); if the model fails on its own, check it "
        "runs eagerly on the example batch first.")


__all__ = ["explain_trace_failure"]
