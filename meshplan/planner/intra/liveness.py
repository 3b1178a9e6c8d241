"""Op-by-op memory of one micro-batch's forward and backward: what the simulator's memory
timeline steps through (`meshplan.sim.engine`).

The planner's memory model (`OpCosts.memory`, the ILP's live sets) charges a plan with every
kept activation and every gradient at once. A step never holds both: gradients are made in
backward while the activations are released, and between them are values the sum leaves out,
measured as the peak on CPU processes — the forward's temporaries (a loss head's logits
before its log-softmax) and the backward's gradients in flight (the logits' gradient next to
the log-softmax's). This pass walks the program once each way, on the local sizes of the
chosen layouts:

- forward: kept values accumulate (they stay for backward); a value autograd does not keep
  lives until its last user has run; a view shares its base's storage and keeps it alive;
- backward, in reverse order: each op's output gradient and the input gradients it makes are
  live together with the kept values whose own backward has not run yet (a kept value is
  released after its own op's backward: a conservative stand-in for "after the last op that
  saved it") and with the parameter gradients made so far; a gradient that already exists is
  accumulated (the new one is a temporary).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Value:
    """One node of the program as the walk sees it: ``nbytes`` is its output's local size per
    device; ``kept``: autograd keeps it for backward (its bytes are the planner's kept
    activations); ``view``: it shares its first input's storage; ``grad``: a gradient flows
    to it; ``param_grad``: for a parameter, the gradient bytes a device holds (its shard
    under ZeRO)."""

    name: str
    role: str
    inputs: tuple[str, ...]
    nbytes: float
    kept: bool = False
    view: bool = False
    grad: bool = False
    param_grad: float = 0.0


@dataclass(frozen=True)
class StepPeaks:
    """Per device and micro-batch: ``kept_bytes`` held between the passes; the largest bytes
    of activations and gradients (parameters and optimizer state left out) during the
    forward, during a backward that makes the parameter gradients (the first micro-batch's),
    and during one that accumulates into gradients already held (``backward_held_peak``:
    those gradients not counted); ``grad_bytes``: the parameter gradients held after it."""

    kept_bytes: float
    forward_peak: float
    backward_peak: float
    backward_held_peak: float
    grad_bytes: float


def step_peaks(values: Sequence[Value], loss: str) -> StepPeaks:
    """Walk ``values`` (topological order, the loss among them) forward and back (module
    docstring). Raises ValueError if ``loss`` is not one of them."""
    by_name = {v.name: v for v in values}
    if loss not in by_name:
        raise ValueError(f"the loss {loss!r} is not among the program's values")
    kept, forward_peak = _forward(values, loss)
    backward_peak, held_peak = _backward(values, by_name, loss, kept)
    grads = sum(v.param_grad for v in values if v.role == "param")
    return StepPeaks(kept, max(forward_peak, kept), backward_peak, held_peak, grads)


def _forward(values: Sequence[Value], loss: str) -> tuple[float, float]:
    """Kept bytes at the end of the forward and the forward's peak."""
    root: dict[str, str] = {}
    uses: Counter[str] = Counter()
    for v in values:
        root[v.name] = root.get(v.inputs[0], v.inputs[0]) if v.view and v.inputs else v.name
        for u in set(v.inputs):
            uses[root.get(u, u)] += 1
    uses[loss] += 1   # the loss is read after the forward
    kept = temporaries = peak = 0.0
    live: dict[str, float] = {}
    for v in values:
        if v.role in ("param", "buffer"):
            continue
        made = 0.0
        if v.kept:
            kept += v.nbytes
        elif not v.view:
            made = v.nbytes
            if uses[v.name]:
                live[v.name] = made
                temporaries += made
        peak = max(peak, kept + temporaries + (0.0 if v.name in live else made))
        for u in set(v.inputs):
            r = root.get(u, u)
            uses[r] -= 1
            if not uses[r] and r in live:
                temporaries -= live.pop(r)
    return kept, peak


class _Gradients:
    """The gradients of a backward walk: those made and not yet consumed (``in_flight``) and
    the parameters' (``made``)."""

    def __init__(self, by_name: dict[str, Value], loss: str) -> None:
        self.by_name = by_name
        self.flowing = {loss: by_name[loss].nbytes}
        self.in_flight = by_name[loss].nbytes
        self.made = 0.0
        self._params: set[str] = set()

    def op(self, v: Value) -> tuple[float, float]:
        """``v``'s backward makes its inputs' gradients: (bytes accumulated into gradients
        that exist, bytes of parameter gradients it adds to)."""
        extra = new_params = 0.0
        for u in dict.fromkeys(v.inputs):
            w = self.by_name.get(u)
            if w is None or not w.grad and w.role != "param":
                continue
            if w.role == "param":
                if u not in self._params:
                    self._params.add(u)
                    self.made += w.param_grad
                new_params += w.param_grad
            elif u in self.flowing:
                extra += w.nbytes     # accumulated into the existing gradient
            else:
                self.flowing[u] = w.nbytes
                self.in_flight += w.nbytes
        return extra, new_params

    def done(self, v: Value) -> None:
        self.in_flight -= self.flowing.pop(v.name)


def _backward(values: Sequence[Value], by_name: dict[str, Value], loss: str,
              kept: float) -> tuple[float, float]:
    """The backward's peak with the parameter gradients it makes, and without them."""
    g = _Gradients(by_name, loss)
    peak = held_peak = 0.0
    for v in reversed(values):
        if v.name not in g.flowing:
            continue
        extra, new_params = g.op(v)
        now = kept + g.in_flight + extra
        peak = max(peak, now + g.made)
        held_peak = max(held_peak, now + new_params)
        g.done(v)
        if v.kept:
            kept -= v.nbytes
    return peak, held_peak


def layered_peaks(values: Sequence[Value], loss: str, layer_of: Mapping[str, int]
                  ) -> StepPeaks:
    """The same walk for a program recomputed layer by layer (Megatron-LM's full
    recomputation: `runtime/step_modes.layered`): a micro-batch keeps only what each layer
    reads from before it (``kept_bytes``); the forward holds those and one layer's
    temporaries; the backward replays one layer at a time, holding the layers' inputs not yet
    released, that layer's kept values and the gradients in flight. ``layer_of``: each value's
    layer (values it lacks count with the program's first)."""
    by_name = {v.name: v for v in values}
    if loss not in by_name:
        raise ValueError(f"the loss {loss!r} is not among the program's values")

    first = min((layer_of[v.name] for v in values if v.name in layer_of), default=0)

    def layer(name: str) -> int:   # a stage's received values: its first layer
        return layer_of.get(name, first)

    # What each layer reads from an earlier layer, each value once, at its first reader.
    boundary: dict[str, int] = {}
    for v in values:
        for u in v.inputs:
            w = by_name.get(u)
            if w is None or w.role in ("param", "buffer") or layer(u) == layer(v.name):
                continue
            boundary.setdefault(u, layer(v.name))
    inputs = sum(by_name[u].nbytes for u in boundary if not by_name[u].view)
    # Forward: a layer's values live while it runs (nothing is kept for backward).
    per_layer: dict[int, list[Value]] = {}
    for v in values:
        per_layer.setdefault(layer(v.name), []).append(v)
    forward_peak = inputs
    for members in per_layer.values():
        _, peak = _forward([dataclasses.replace(v, kept=False) for v in members],
                           members[-1].name)
        forward_peak = max(forward_peak, inputs + peak)
    # Backward: at a layer's replay its kept values come back, and leave as its ops finish.
    g = _Gradients(by_name, loss)
    held_inputs, replayed, current = inputs, 0.0, None
    peak = held_peak = 0.0
    for v in reversed(values):
        if layer(v.name) != current:
            current = layer(v.name)
            replayed = sum(w.nbytes for w in per_layer.get(current, ()) if w.kept)
        if boundary.get(v.name) is not None and not v.view:
            held_inputs -= v.nbytes   # the layers reading it are done with it
        if v.name not in g.flowing:
            continue
        extra, new_params = g.op(v)
        now = held_inputs + replayed + g.in_flight + extra
        peak = max(peak, now + g.made)
        held_peak = max(held_peak, now + new_params)
        g.done(v)
        if v.kept:
            replayed -= v.nbytes
    grads = sum(v.param_grad for v in values if v.role == "param")
    return StepPeaks(inputs, forward_peak, peak, held_peak, grads)
