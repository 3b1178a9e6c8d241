"""Trace forward + loss of an ``nn.Module`` into an aten-level fx graph on fake tensors.

This is the one module that touches torch's tracing internals (``make_fx`` and
``FakeTensorMode``), so a torch upgrade breaks in one place. Nothing is allocated: parameters,
buffers and the example batch become fake *CPU* tensors (fake CUDA breaks autograd on a CPU
build), so a model built on the ``meta`` device traces at any size.

The traced function is the step's loss on ``functional_call(model, state, args, kwargs)``
(``capture/batch.py``: the batch forms and the loss conventions); its placeholders are, in
order, every parameter, every buffer, every batch tensor (positional, keyword, target). The
backward pass is not traced: at run time autograd differentiates the sharded forward program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from meshplan.capture.batch import BatchLayout, flatten_batch, step_loss

aten = torch.ops.aten


@dataclass(frozen=True)
class Traced:
    """An fx graph of forward + loss and the meaning of its placeholders.

    ``placeholders[i]`` is ``(role, name)`` for the i-th placeholder node, where ``role`` is
    ``"param"``, ``"buffer"``, ``"input"`` or ``"target"`` and ``name`` the state-dict name (for
    params/buffers) or the batch tensor's name (``"input{i}"``, a keyword, ``"target"``);
    ``batch`` rebuilds the model call from the batch tensors.
    """

    graph_module: GraphModule
    placeholders: tuple[tuple[str, str], ...]
    batch: BatchLayout | None = None


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


def trace(model: nn.Module, loss_fn: Callable | None, example_batch: Any) -> Traced:
    """Trace one step's loss (``loss_fn(model(...), target)``, ``loss_fn(model(...))`` or the
    model's own loss when ``loss_fn`` is None; see ``capture/batch.py`` for the batch forms)
    at aten level without allocating memory.

    Raises TypeError for a malformed batch and ValueError if the loss is not a scalar tensor.
    """
    layout, batch = flatten_batch(example_batch)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_state = {k: _as_fake(mode, v) for k, v in {**params, **buffers}.items()}
    fake_batch = [_as_fake(mode, t) for t in batch.values()]
    names = list(fake_state)

    def step(state_list: list[torch.Tensor], batch_list: list[torch.Tensor]) -> torch.Tensor:
        args, kwargs, target = layout.call(batch_list)
        out = functional_call(model, dict(zip(names, state_list)), args, kwargs, strict=False)
        return step_loss(loss_fn, out, target)

    with mode:
        gm = make_fx(step, decomposition_table=_decompositions())(
            list(fake_state.values()), fake_batch)
    loss = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    val = loss.meta.get("val") if isinstance(loss, torch.fx.Node) else None
    if val is None or tuple(val.shape) != ():
        raise ValueError("loss_fn must return a scalar tensor (e.g. a mean-reduced loss); got "
                         f"{None if val is None else tuple(val.shape)}")
    roles = ([("param", k) for k in params] + [("buffer", k) for k in buffers]
             + [("target" if k == "target" and layout.has_target else "input", k)
                for k in batch])
    return Traced(gm, tuple(roles), layout)
