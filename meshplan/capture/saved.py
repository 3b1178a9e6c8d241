"""Which traced values autograd keeps for backward.

The memory of a training step is, besides the state, what autograd saves between forward and
backward: a matmul keeps its operands, ReLU its output, an addition nothing. Rather than a table
per op, capture asks autograd itself: the trace runs the forward with parameters that require a
gradient, so every op records its backward and saves what that backward needs, and a
saved-tensor hook (``torch.autograd.graph.saved_tensors_hooks``) sees each saved tensor as it
is packed. The tracing proxy attached to that tensor names the graph node that produced it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.fx import GraphModule
from meshplan.torch_api import get_proxy_mode, get_proxy_slot


class SavedForBackward:
    """Collects the names of traced nodes whose values autograd saves (see module docstring)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        mode = get_proxy_mode()
        if mode is not None:
            slot = get_proxy_slot(t, mode.tracer, None)
            if slot is not None:
                self.names.add(slot.proxy.node.name)
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def same_nodes(names: set[str], before: GraphModule, after: GraphModule) -> set[str]:
    """The ``names`` of ``before`` as ``after`` (a retrace of it) names the same values: an op
    under its name if ``after`` has the same op there (a retrace that rewrote in-place ops may
    give a name to another op), a placeholder (a parameter autograd saves itself, a layer
    norm's weight) under the name of the placeholder in its position."""
    old = {n.name: n.target for n in before.graph.nodes if n.op != "placeholder"}
    new = {n.name: n.target for n in after.graph.nodes if n.op != "placeholder"}
    inputs = dict(zip((n.name for n in before.graph.nodes if n.op == "placeholder"),
                      (n.name for n in after.graph.nodes if n.op == "placeholder")))
    return {inputs.get(name, name) for name in names
            if name in inputs or (name in new and new[name] == old.get(name))}


def renamed(names: set[str], renames: Mapping[str, str], traced: GraphModule) -> frozenset[str]:
    """``names`` after a rewrite that replaced nodes (``renames``: old name -> the node that
    now holds its value), kept where ``traced`` has them."""
    present = {n.name for n in traced.graph.nodes}
    out = set()
    for name in names:
        while name in renames:
            name = renames[name]
        if name in present:
            out.add(name)
    return frozenset(out)
