"""Where one device's autograd stops, the traced program stops its gradients too.

make_fx records aten ops below autograd, so a value the model computes under
``torch.no_grad()`` (a normalizer's statistic, a moving average, a teacher's output) is traced
as the same op as one computed with gradients: the local programs, which autograd
differentiates, would pass gradients through it where one device passes none. While tracing, a
torch-function mode (`GradRecord`, above autograd: a dispatch mode below it made make_fx
record autograd's own detaches) notes for every traced value whether autograd recorded it
(``requires_grad`` as the calls reading it saw it) and whether gradients were enabled when it
was made. `detach_where_autograd_stops` then puts a ``detach`` on every edge from a value
autograd recorded into an op made without gradients whose result it did not record: one
device's autograd sees no dependence there.

An ``autograd.Function``'s forward also runs with gradients disabled, though its output has
them (a user's own Function: meshplan differentiates its traced forward). Its output is a
value autograd recorded, made with gradients disabled by an op that is not an in-place write,
from some value it did not record; the ops behind it back to recorded values are its forward,
and keep their gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from meshplan.torch_api import OpOverload, get_proxy_mode, get_proxy_slot

aten = torch.ops.aten


class GradRecord(TorchFunctionMode):
    """Within a make_fx trace, at torch's Python API (above autograd, where ``requires_grad``
    is already what autograd made of a result): whether autograd recorded each traced value,
    as the last call that read it saw it, else as the call that made it; and whether gradients
    were enabled when that call made it."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[Node, bool] = {}
        self.made: dict[Node, bool] = {}
        self.enabled: dict[Node, bool] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        mode = get_proxy_mode()
        if mode is not None:
            for t in tree_leaves((args, kwargs)):
                node = _node_of(t, mode)
                if node is not None:
                    self.read[node] = t.requires_grad
        out = func(*args, **(kwargs or {}))
        if mode is not None:
            enabled = torch.is_grad_enabled()
            for t in tree_leaves(out):
                node = _node_of(t, mode)
                if node is not None:
                    self.made[node] = t.requires_grad
                    self.enabled.setdefault(node, enabled)
        return out

    def recorded(self, node: Node) -> bool | None:
        """Whether autograd recorded ``node``'s value; None: no call made or read it."""
        return self.read.get(node, self.made.get(node))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with self:
            yield


def _node_of(t: Any, mode: Any) -> Node | None:
    slot = get_proxy_slot(t, mode.tracer, None) if isinstance(t, torch.Tensor) else None
    return slot.proxy.node if slot is not None else None


def detach_where_autograd_stops(gm: GraphModule, record: GradRecord,
                                inputs: Sequence[torch.Tensor]) -> bool:
    """A ``detach`` on each edge where one device's autograd stops (module docstring);
    ``inputs``: the traced function's flat arguments, in placeholder order. Returns whether any
    was added."""
    graph = gm.graph
    enabled = _grad_modes(graph, record)
    recorded: dict[Node, bool] = {}
    holders = iter(inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            t = next(holders, None)
            recorded[node] = isinstance(t, torch.Tensor) and t.requires_grad
            continue
        seen = record.recorded(node)
        # Unseen: a composite function's inner op, a getitem: as what it is computed from,
        # where gradients were enabled (a linear's matmul under no_grad reads a weight autograd
        # records, and records nothing).
        recorded[node] = seen if seen is not None else enabled[node] is not False and \
            any(recorded.get(a, False) for a in node.all_input_nodes)
    forward_of_functions = _functions_forward(graph, enabled, recorded)
    cuts = [(u, v) for v in graph.nodes
            if isinstance(v.target, OpOverload) and enabled[v] is False
            and not recorded[v] and v not in forward_of_functions and _floating(v)
            for u in v.all_input_nodes
            if recorded[u] and isinstance(u.meta.get("val"), torch.Tensor)]
    if not cuts:
        return False
    detached: dict[Node, Node] = {}
    for u, v in cuts:
        if u not in detached:
            with graph.inserting_after(u):
                cut = graph.create_node("call_function", aten.detach.default, (u,),
                                        name="detach")   # as make_fx names it
            cut.meta.update(val=u.meta.get("val"))
            detached[u] = cut
        v.replace_input_with(u, detached[u])
    gm.recompile()
    return True


def _floating(node: Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)


def _grad_modes(graph: Any, record: GradRecord) -> dict[Node, bool | None]:
    """Whether gradients were enabled when each node was made: as `GradRecord` saw its call,
    else (an inner op of a composite call, which runs in its call's mode: F.linear's matmul)
    as the nodes reading it were, where they agree; None: unknown."""
    modes: dict[Node, bool | None] = {}
    for node in reversed(graph.nodes):
        mode = record.enabled.get(node)
        if mode is None and node.op == "call_function":
            readers = {modes.get(u) for u in node.users} - {None}
            mode = readers.pop() if len(readers) == 1 else None
        modes[node] = mode
    return modes


def _functions_forward(graph: Any, enabled: dict[Node, bool | None],
                       recorded: dict[Node, bool]) -> set[Node]:
    """The ops of autograd.Function forwards: behind each output autograd recorded from
    operands it did not (made with gradients disabled), back to recorded values."""
    outputs = [n for n in graph.nodes if recorded[n] and enabled[n] is False
               and not (isinstance(n.target, OpOverload) and n.target._schema.is_mutable)
               and not all(recorded[a] for a in n.all_input_nodes)]
    inside: set[Node] = set()
    todo = [a for n in outputs for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in inside or recorded[n] or n.op != "call_function":
            continue
        inside.add(n)
        todo.extend(n.all_input_nodes)
    return inside
