"""Explain a trace that torch refused: which aten op, in which module, and what to do instead.

make_fx runs the model on fake tensors, which carry shapes but no data. Ops whose output shape
depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``) cannot be
traced that way, and some kernels only accept other dtypes or devices under fake tensors
(``_grouped_mm``). torch reports those deep inside its dispatcher; this module turns them into one
ValueError a user can act on.
"""

from __future__ import annotations

import os
import threading
import types
from typing import Any
import torch
from torch import nn
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)

from meshplan.torch_api import (DataDependentOutputException, DynamicOutputShapeException,
                                OpOverload)

_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


def _failing_op(exc: BaseException) -> str | None:
    """The aten op torch was running: named by the exception, else found in its traceback."""
    func = getattr(exc, "func", None)
    if func is None:
        for frame in _frames(exc):
            cand = frame.f_locals.get("func")
            if isinstance(cand, OpOverload):
                func = cand  # keep the innermost
    return None if func is None else str(func).removeprefix("aten.")


class ModuleStack:
    """The modules whose forward is running, innermost last, recorded by global forward hooks
    while one trace runs (in the tracing thread only). After a failure the stack still holds
    the module that failed: its forward never returned."""

    def __init__(self) -> None:
        self.stack: list[nn.Module] = []
        self._thread = threading.get_ident()
        self._handles: list[Any] = []

    def __enter__(self) -> "ModuleStack":
        def pre(module: nn.Module, _args: Any) -> None:
            if threading.get_ident() == self._thread:
                self.stack.append(module)

        def post(module: nn.Module, _args: Any, _out: Any) -> None:
            if threading.get_ident() == self._thread and self.stack:
                self.stack.pop()

        self._handles = [register_module_forward_pre_hook(pre),
                         register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def innermost(self, model: nn.Module) -> str | None:
        names = {id(m): name for name, m in model.named_modules()}
        for module in reversed(self.stack):
            if id(module) in names:
                name = names[id(module)]
                kind = type(module).__name__
                return f"{name} ({kind})" if name else f"the model ({kind})"
        return None


def _frames(exc: BaseException) -> list[types.FrameType]:
    """Frames of the exception and of the ones it was raised from, outermost first."""
    out: list[types.FrameType] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame not in out:
                out.append(tb.tb_frame)
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return out


def _user_line(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame outside torch (the model's own code)."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    found = None
    for frame in _frames(exc):
        name = frame.f_code.co_filename
        if not name.startswith((torch_dir, here)) and "<" not in name:
            found = f"{name}:{frame.f_lineno}"
    return found


def _is_data_dependent(exc: BaseException) -> bool:
    if isinstance(exc, _DATA_DEPENDENT):
        return True
    # Symbolic-shape guards on data (``if mask.any():``) surface under this name.
    return type(exc).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


def explain_trace_failure(exc: BaseException, model: nn.Module, modules: ModuleStack
                          ) -> ValueError:
    """A ValueError naming the op and module torch failed on, with a remedy when one is known."""
    op = _failing_op(exc)
    module = modules.innermost(model)
    where = f"aten op '{op}'" if op else "an op"
    if module:
        where += f" in module {module}"
    line = _user_line(exc)
    if line:
        where += f" (at {line})"
    if op and op.startswith("_local_scalar_dense"):
        return ValueError(
            f"meshplan cannot trace {where}: the model reads a tensor's value in Python "
            "(.item(), bool(t), int(t), `if t ...:` on a tensor), and a plan is made from shapes "
            "alone. Compute the same thing with tensor ops (torch.where, a mask product, "
            "clamp) or decide it from shapes or Python numbers.")
    if _is_data_dependent(exc):
        return ValueError(
            f"meshplan cannot trace {where}: its output shape depends on the values of its "
            "input (nonzero, boolean-mask indexing, unique, masked_select, dropless MoE routing"
            "), and a plan needs every shape before training. Use a static shape instead: "
            "e.g. a capacity-based MoE (fixed slots per expert, as meshplan.zoo.moe_layer), "
            "torch.where / multiplying by a mask instead of indexing with it, or padding to a "
            "fixed size.")
    if "leaf Variable that requires grad is being used in an in-place operation" in str(exc):
        return ValueError(
            f"meshplan cannot trace {where}: the forward writes into a parameter in place "
            "(nn.Embedding's max_norm renormalizes the rows it looks up; a hand-written weight "
            "update), and a plan trains forwards that leave their parameters to the optimizer. "
            "Drop max_norm, or renormalize after optimizer.step(), outside the forward.")
    detail = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else \
        type(exc).__name__
    return ValueError(
        f"meshplan cannot trace {where} on fake tensors (shapes without data, CPU): {detail}. "
        "If the op only supports other dtypes or devices (e.g. _grouped_mm), use its plain "
        "equivalent (a loop or einsum over the groups); if the model fails on its own, check it "
        "runs eagerly on the example batch first.")


def refuse_gradient_hooks(model: nn.Module) -> None:
    """ValueError naming the first gradient hook on ``model``: a parameter's
    (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``) or a module's backward
    hook (``register_full_backward_hook``, its pre-hook, or a global one). One device runs it
    on the gradient; a plan's ranks differentiate the traced program, whose gradients never
    pass through it, so training would differ, silently."""
    found = None
    for name, p in model.named_parameters():
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
            found = f"parameter {name!r} has a gradient hook (register_hook or " \
                    "register_post_accumulate_grad_hook)"
            break
    if found is None:
        for name, m in model.named_modules():
            if m._backward_hooks or m._backward_pre_hooks:
                found = f"module {name or type(m).__name__!r} has a backward hook " \
                        "(register_full_backward_hook or register_full_backward_pre_hook)"
                break
    if found is None and (nn.modules.module._global_backward_hooks or
                          nn.modules.module._global_backward_pre_hooks):
        found = "a global module backward hook is registered " \
                "(nn.modules.module.register_module_full_backward_hook)"
    if found is not None:
        raise ValueError(
            f"meshplan cannot train this model as one device does: {found}. A plan's ranks "
            "compute their pieces of the gradients from the traced program, where the hook "
            "would not run. Remove it: clip gradients with model.clip_grad_norm_ or "
            "OptimizerSpec(max_grad_norm=...), and change the loss or the forward (a custom "
            "autograd.Function) for anything else the hook did to the gradients.")


__all__ = ["ModuleStack", "explain_trace_failure", "refuse_gradient_hooks"]
