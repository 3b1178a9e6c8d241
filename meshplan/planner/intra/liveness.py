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


def segmented_peaks(values: Sequence[Value], loss: str, segment_of: Mapping[str, int]
                    ) -> StepPeaks:
    """The same walk for a program whose segments are recomputed (`planner/recompute.py`,
    `runtime/step_modes.segmented`): ``segment_of`` maps each replayed value to its segment;
    the values it lacks run plainly. A micro-batch keeps what a segment reads from outside it
    and what it passes out (``kept_bytes``, with the plain values autograd keeps); the forward
    holds those and one segment's temporaries; the backward replays one segment at a time,
    holding the boundary values not yet released, that segment's kept values and the
    gradients in flight. Every value in ``segment_of`` (each clustered layer a segment) is
    Megatron-LM's full recomputation."""
    by_name = {v.name: v for v in values}
    if loss not in by_name:
        raise ValueError(f"the loss {loss!r} is not among the program's values")

    def seg(name: str) -> int | None:
        return segment_of.get(name)

    # What a segment reads from outside it, or passes out, each value once.
    boundary: set[str] = set()
    for v in values:
        for u in v.inputs:
            w = by_name.get(u)
            if w is None or w.role in ("param", "buffer") or seg(u) == seg(v.name):
                continue
            if seg(u) is not None or seg(v.name) is not None:
                boundary.add(u)
    inputs = sum(by_name[u].nbytes for u in boundary if not by_name[u].view)
    held_plain = sum(v.nbytes for v in values if seg(v.name) is None and v.kept and not v.view
                     and v.name not in boundary and v.role not in ("param", "buffer"))
    # Forward, in order: what a micro-batch keeps accumulates; the rest (a replayed segment's
    # values, a plain value autograd does not keep) lives until its last reader has run.
    per_segment: dict[int, list[Value]] = {}
    for v in values:
        if seg(v.name) is not None:
            per_segment.setdefault(seg(v.name), []).append(v)
    _, forward_peak = _forward([dataclasses.replace(v, kept=v.name in boundary or (
        v.kept and seg(v.name) is None)) for v in values], loss)
    # Backward: at a segment's replay its kept values come back, and leave as its ops finish;
    # a plain value autograd kept leaves after its own op's backward.
    g = _Gradients(by_name, loss)
    held, replayed, current = inputs + held_plain, 0.0, object()
    peak = held_peak = 0.0
    for v in reversed(values):
        if seg(v.name) != current:
            current = seg(v.name)
            replayed = 0.0 if current is None else \
                sum(w.nbytes for w in per_segment[current] if w.kept)
        if v.name in boundary and not v.view:
            held -= v.nbytes   # the segments reading it are done with it
        if v.name not in g.flowing:
            continue
        extra, new_params = g.op(v)
        now = held + replayed + g.in_flight + extra
        peak = max(peak, now + g.made)
        held_peak = max(held_peak, now + new_params)
        g.done(v)
        if v.kept and current is not None:
            replayed -= v.nbytes
        elif v.kept and not v.view and v.name not in boundary:
            held -= v.nbytes
    grads = sum(v.param_grad for v in values if v.role == "param")
    return StepPeaks(inputs + held_plain, forward_peak, peak, held_peak, grads)
