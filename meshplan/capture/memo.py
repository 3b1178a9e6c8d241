"""One capture per model, loss and batch layout in a process, safe from several threads.

make_fx patches ``torch.nn.Module.__call__`` for the whole process while it traces, so a thread
that runs any module (a rank's training step) while another thread traces is intercepted by
that trace. Emulated ranks are threads sharing one model; each builds a Trainer, which captures.
Capturing under one lock, and handing every later caller the capture already made for the same
model, loss function and batch layout, means tracing happens once and before any rank runs a
step. The captured program is immutable (`Traced`, `Graph`), so sharing it is safe.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

import torch

_LOCK = threading.RLock()
# The most recent captures (a bound, not a weak map: a loss_fn closing over its model would keep
# a weakly keyed entry alive forever). Entries hold the model weakly and the loss_fn strongly,
# so neither id can be reused by another object while its entry exists.
_RECENT = 8
_CACHE: "collections.OrderedDict[Any, tuple[weakref.ref, Any, Any]]" = collections.OrderedDict()
# Programs (`Graph`s) made in another process for the same arguments: a trace made ahead in a
# forked child comes back as its graph only (its fx module does not pickle), kept as the
# captures are.
_GRAPHS: "collections.OrderedDict[Any, tuple[weakref.ref, Any, Any]]" = collections.OrderedDict()


def _layout(x: Any) -> Any:
    """Shapes and dtypes of a (nested) batch: what the trace depends on besides the model."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), str(x.dtype))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_layout(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _layout(v)) for k, v in x.items()))
    return ("V", repr(x))


def _key(model: torch.nn.Module, loss_fn: Any, example_batch: Any) -> Any:
    state = tuple((k, tuple(v.shape), str(v.dtype))
                  for k, v in (*model.named_parameters(), *model.named_buffers()))
    modes = tuple(m.training for m in model.modules())  # dropout and batch norm trace differently
    return (id(loss_fn), _layout(example_batch), state, modes)


def _held(table: "collections.OrderedDict", model: torch.nn.Module, loss_fn: Any,
          example_batch: Any) -> Any | None:
    """What ``table`` holds for these arguments (its entry's model and loss_fn the very
    objects), or None."""
    hit = table.get((id(model), _key(model, loss_fn, example_batch)))
    return hit[2] if hit is not None and hit[0]() is model and hit[1] is loss_fn else None


def _keep(table: "collections.OrderedDict", model: torch.nn.Module, loss_fn: Any,
          example_batch: Any, value: Any) -> None:
    """``value`` kept in ``table`` for these arguments, as its newest of `_RECENT`."""
    key = (id(model), _key(model, loss_fn, example_batch))
    table[key] = (weakref.ref(model), loss_fn, value)
    table.move_to_end(key)
    while len(table) > _RECENT:
        table.popitem(last=False)


def remember_program(model: torch.nn.Module, loss_fn: Any, example_batch: Any, graph: Any
                     ) -> None:
    """Keep ``graph``, the program of these arguments made in another process, for
    `program_made_already`."""
    with _LOCK:
        _keep(_GRAPHS, model, loss_fn, example_batch, graph)


def program_made_already(model: torch.nn.Module, loss_fn: Any, example_batch: Any
                         ) -> Any | None:
    """The program (`Graph`) of these arguments made in another process (`remember_program`)
    or captured here, or None (nothing is traced). The one made elsewhere first: where both
    are kept, a search read that one (the capture here came after, for its fx module), and
    a later search of the same request reads the same program, so that its stage prices,
    keyed by the program's signatures, are the ones the first made (`price_sharing.py`)."""
    with _LOCK:
        graph = _held(_GRAPHS, model, loss_fn, example_batch)
        if graph is not None:
            return graph
        made = _held(_CACHE, model, loss_fn, example_batch)
        return None if made is None else made[1]


def captured_once(model: torch.nn.Module, loss_fn: Any, example_batch: Any,
                  capture: Callable[[torch.nn.Module, Any, Any], Any]) -> Any:
    """``capture(model, loss_fn, example_batch)``, made once per key and under one lock."""
    with _LOCK:
        hit = _held(_CACHE, model, loss_fn, example_batch)
        if hit is None:
            hit = capture(model, loss_fn, example_batch)
        _keep(_CACHE, model, loss_fn, example_batch, hit)
        return hit


def captured_in_mode(model: torch.nn.Module, loss_fn: Any, example_batch: Any,
                     training: bool) -> Any:
    """The capture of ``model`` with every module in training mode ``training`` (``model.eval()``
    for False), its modules' own modes restored after; under the lock, so that no other
    thread's capture sees the modes switched."""
    from meshplan.capture.to_ir import capture
    with _LOCK:
        modes = [(m, m.training) for m in model.modules()]
        try:
            model.train(training)
            return capture(model, loss_fn, example_batch)
        finally:
            for m, mode in modes:
                m.training = mode
