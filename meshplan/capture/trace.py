"""Trace forward + loss of an ``nn.Module`` into an aten-level fx graph on fake tensors.

This is the one module that touches torch's tracing internals (``make_fx`` and
``FakeTensorMode``), so a torch upgrade breaks in one place. Nothing is allocated: parameters,
buffers and the example batch become fake *CPU* tensors (fake CUDA breaks autograd on a CPU
build), so a model built on the ``meta`` device traces at any size.

The traced function is the batch's loss with the model called through
``functional_call(model, state, ...)`` (`meshplan.capture.batch`: ``loss_fn(model(*inputs),
target)``, or a model called with keyword arguments that may return its own loss); its
placeholders are, in order, every parameter, every buffer and every tensor of the batch. The
backward pass is not traced: at run time autograd differentiates the sharded forward program.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                          DynamicOutputShapeException, FakeTensorMode)
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from meshplan.capture.batch import batch_layout, batch_tensors, forward_loss
from meshplan.capture.cse import merge_common_subexpressions

aten = torch.ops.aten

# make_fx patches module-level state while it traces, and functional_call swaps the model's own
# parameters for fake ones; emulated ranks are threads of one process sharing a model, so traces
# run one at a time and a thread reads a model's state only outside a trace (`model_state`).
_TRACE_LOCK = threading.Lock()


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by state-dict name (detached), read while no trace
    has them swapped out."""
    with _TRACE_LOCK:
        return {k: v.detach() for k, v in {**dict(model.named_parameters()),
                                           **dict(model.named_buffers())}.items()}


@dataclass(frozen=True)
class Traced:
    """An fx graph of forward + loss and the meaning of its placeholders.

    ``placeholders[i]`` is ``(role, name)`` for the i-th placeholder node, where ``role`` is
    ``"param"``, ``"buffer"``, ``"input"`` or ``"target"`` and ``name`` the state-dict name (for
    params/buffers) or the batch tensor's name (``"input{i}"`` / ``"target"``, or a keyword).
    """

    graph_module: GraphModule
    placeholders: tuple[tuple[str, str], ...]


def _addmm_as_mm_add(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                     beta: float = 1, alpha: float = 1) -> torch.Tensor:
    # The bias of a row-parallel linear must be added after the partial sums are reduced, so
    # the planner needs the matmul and the bias add as two ops (Alpa and Megatron do the same).
    out = aten.mm.default(a, b)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(out, bias)


def _conv_bias_apart(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *args: Any
                     ) -> Any:
    # As for addmm: a convolution split over input channels yields partial sums, and its bias
    # must be added once, after they are reduced.
    if bias is None:
        return NotImplemented
    out = aten.convolution.default(x, w, None, *args)
    shape = [1, -1] + [1] * (out.dim() - 2)
    return aten.add.Tensor(out, aten.view.default(bias, shape))


def _decompositions() -> dict[Any, Callable]:
    return {aten.addmm.default: _addmm_as_mm_add, aten.convolution.default: _conv_bias_apart}


def _as_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    # torch.empty inside the mode gives a fake CPU tensor whatever device t lives on (meta too).
    with mode:
        return torch.empty(t.shape, dtype=t.dtype)


def _op_name(e: Exception) -> str:
    func = getattr(e, "func", None)
    name = getattr(func, "__name__", None) or (e.args[0] if e.args else type(e).__name__)
    return str(getattr(func, "_schema", None) and func._schema.name.split("::")[-1] or name)


def _module_of(e: BaseException, model: nn.Module) -> str:
    """`` in module 'layers.0.router' (Router)``: the innermost module whose forward was running
    when ``e`` was raised, from the traceback."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = owner
        tb = tb.tb_next
    if found is None:
        return ""
    return f" in module '{names[id(found)] or '(the model)'}' ({type(found).__name__})"


def trace(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
          example_batch: Any) -> Traced:
    """Trace one batch's loss (see `meshplan.capture.batch` for the batch forms and how the
    loss is formed) at aten level without allocating memory.

    Raises TypeError for a malformed batch, ValueError if the loss is not a scalar tensor, the
    program's shapes depend on its data, or an op cannot be traced.
    """
    with _TRACE_LOCK:
        return _trace(model, loss_fn, example_batch)


def _trace(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, example_batch: Any
           ) -> Traced:
    layout = batch_layout(example_batch)
    tensors = batch_tensors(example_batch)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    # Real tensors a model closes over (not parameters or buffers) become constants of the trace.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # Parameters trace as tensors that require a gradient, so ops pick their differentiable
    # variants (embedding_bag, not _embedding_bag_forward_only).
    fake_state = {k: _as_fake(mode, v).requires_grad_(k in params and v.requires_grad)
                  for k, v in {**params, **buffers}.items()}
    fake_batch = [_as_fake(mode, tensors[n]) for n in layout.names]
    names = list(fake_state)

    def step(state_list: list[torch.Tensor], batch: list[torch.Tensor]) -> torch.Tensor:
        state = dict(zip(names, state_list))

        def call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, state, args, kwargs, strict=False)

        return forward_loss(call, loss_fn, layout, batch)

    # Tracing is what torch.compile/export do: libraries (Hugging Face) then skip data-dependent
    # checks (``if (mask == 1).all()``) that fake tensors cannot answer.
    try:
        with torch.compiler._compile_session_context(), mode:
            gm = make_fx(step, decomposition_table=_decompositions())(
                list(fake_state.values()), fake_batch)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ValueError(
            f"the program's shapes depend on its data at '{_op_name(e)}'{_module_of(e, model)}: "
            "meshplan plans on fake tensors, whose values are unknown, and every rank must know "
            "every shape. Give that step a static shape: e.g. a capacity-based mixture of experts "
            "instead of dropless routing (nonzero), a mask instead of boolean indexing"
        ) from None
    except RuntimeError as e:  # an op that cannot run on fake CPU tensors as called
        raise ValueError(f"tracing the model failed{_module_of(e, model)}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    loss = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    val = loss.meta.get("val") if isinstance(loss, torch.fx.Node) else None
    if val is None or tuple(val.shape) != ():
        raise ValueError("loss_fn must return a scalar tensor (e.g. a mean-reduced loss); got "
                         f"{None if val is None else tuple(val.shape)}")
    roles = ([("param", k) for k in params] + [("buffer", k) for k in buffers]
             + [("target" if n == "target" and layout.kind == "pair" else "input", n)
                for n in layout.names])
    return Traced(merge_common_subexpressions(gm), tuple(roles))
