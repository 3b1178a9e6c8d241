"""Turn a traced fx graph into meshplan's IR (`meshplan.ir.graph.Graph`).

Each fx call becomes one IR node with its normalized op name, signature, FLOPs and bytes.
A multi-output op whose forward reads only its first output is that output (``getitem(op, 0)``
folds into the op; layer norm's statistics, attention's log-sum-exp only feed the backward
pass, which autograd derives at run time); one whose other outputs are read (``topk``'s
indices, ``split``'s pieces) becomes one node per output read. Pointwise aten ops (by their
tag) are elementwise with broadcasting. Tensor constants of the trace are constant nodes. An op
without a rule is planned replicated, with one warning naming it: it never aborts the plan.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
from torch import fx

from meshplan.capture.signature_rules import (CONSTANT_OPS, LIKE_OPS, RULES, OpCall,
                                              elementwise_rule, is_pointwise, is_random)
from meshplan.capture.trace import Traced
from meshplan.ir.graph import Graph, Node, TensorInfo
from meshplan.ir.signatures import Signature, replicated_signature


def _info(val: Any) -> TensorInfo:
    if isinstance(val, (list, tuple)):
        val = val[0]
    return TensorInfo(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))


def _packet(target: Any) -> str:
    name = getattr(target, "__name__", str(target))  # e.g. "addmm.default"
    return name.split(".")[0]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in (*node.args, *node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        out.extend(x for x in items if isinstance(x, fx.Node))
    return out


def _is_multi(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _items_used(node: fx.Node) -> bool:
    """Whether the forward reads outputs of a multi-output op one by one: any output but the
    first, or a list output (split's pieces). Each read output is then an IR node of its own
    (lowering calls the op on local operands and takes that output); otherwise the op is one
    node standing for its first output (layer norm's statistics only feed the backward pass)."""
    if not _is_multi(node):
        return False
    return isinstance(node.meta["val"], list) or any(
        u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users)


def _opcall(node: fx.Node, operands: list[fx.Node], packet: str) -> OpCall:
    return OpCall(packet, tuple(_info(o.meta["val"]).shape for o in operands),
                  _info(node.meta["val"]).shape, tuple(node.args), tuple(node.kwargs.items()))


def _op_node(node: fx.Node, operands: list[str], op_call: OpCall, requires_grad: bool,
             target: Any) -> Node:
    packet = op_call.target
    out = _info(node.meta["val"])
    rule = RULES.get(packet) or (elementwise_rule(packet) if is_pointwise(target) else None)
    r = _apply(rule, op_call)
    if r is None or not _fits(r.sig, op_call.in_shapes, out.shape):
        sig = replicated_signature(tuple(len(s) for s in op_call.in_shapes), len(out.shape))
        name, flops = packet, float(out.numel)
    else:
        sig, name, flops = r.sig, r.name, r.flops
    in_bytes = sum(TensorInfo(s, out.dtype).nbytes for s in op_call.in_shapes)
    differentiable = out.dtype.startswith(("float", "bfloat", "complex"))
    return Node(node.name, "op", name, tuple(operands), out, sig, flops, in_bytes + out.nbytes,
                requires_grad and differentiable)


def _apply(rule: Any, op_call: OpCall) -> Any:
    """The rule's result; None (planned replicated) when the rule does not cover this call --
    an odd variant (a 0-d operand, an unusual overload) must never abort the plan."""
    if rule is None:
        return None
    try:
        return rule(op_call)
    except (ZeroDivisionError, IndexError, KeyError, TypeError, AttributeError,
            AssertionError, StopIteration):
        return None


def _fits(sig: Signature, in_shapes: tuple, out_shape: tuple) -> bool:
    """Whether a signature names one dims entry per operand dim and per output dim."""
    return (len(sig.inputs) == len(in_shapes) and len(sig.output) == len(out_shape)
            and all(len(d) == len(s) for d, s in zip(sig.inputs, in_shapes)))


def to_ir(traced: Traced) -> Graph:
    """Build the IR graph of a traced program (see the module docstring).

    Raises ValueError naming the op when the program draws random numbers meshplan cannot
    reproduce on every rank, or has shapes that depend on data.
    """
    alias: dict[str, str] = {}
    nodes: list[Node] = []
    grad: dict[str, bool] = {}
    placeholders = iter(traced.placeholders)
    for node in traced.graph_module.graph.nodes:  # constants carry their value, not a fake
        if node.op == "get_attr" and "val" not in node.meta:
            node.meta["val"] = getattr(traced.graph_module, node.target)
    loss = None
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            role, state_name = next(placeholders)
            nodes.append(Node(node.name, role, role, (), _info(node.meta["val"]), None,
                              requires_grad=role == "param", state_name=state_name))
        elif node.op == "output":
            out = node.args[0]
            loss = alias.get((out[0] if isinstance(out, (list, tuple)) else out).name)
        elif node.op == "get_attr":  # a tensor constant of the program (torch.tensor(...))
            nodes.append(Node(node.name, "constant", "tensor_constant", (),
                              _info(node.meta["val"]), None))
        elif node.op == "call_function" and node.meta.get("val") is None and not node.users:
            continue  # a check run for its side effect (``_linalg_check_errors``)
        elif node.target is operator.getitem:
            parent = node.args[0]
            if _items_used(parent):
                nodes.append(_item_node(node, alias, grad))
            elif node.args[1] == 0:
                alias[node.name] = alias[parent.name]
            # other outputs of an op read whole feed only the backward pass
        else:
            packet = _packet(node.target)
            operands = _tensor_args(node)
            names = [alias[o.name] for o in operands]
            if (not operands and packet in CONSTANT_OPS) or packet in LIKE_OPS:
                nodes.append(Node(node.name, "constant", packet, (), _info(node.meta["val"]),
                                  None))
            elif _items_used(node):
                pass  # represented by its getitem users
            else:
                _check_supported(node, packet)
                rg = any(grad.get(n, False) for n in names)
                nodes.append(_op_node(node, names, _opcall(node, operands, packet), rg,
                                      node.target))
        if nodes and nodes[-1].name == node.name:
            alias[node.name] = node.name
            grad[node.name] = nodes[-1].requires_grad
    assert loss is not None, "traced graph has no output"
    live = _prune_dead(nodes, loss)
    return Graph(tuple(live), loss, _warn_unsupported(live))


def _check_supported(node: fx.Node, packet: str) -> None:
    if is_random(node.target) and packet not in RULES:
        raise ValueError(
            f"the program draws random numbers with '{packet}'{_where(node)}; meshplan reproduces "
            "one device's random draws only for dropout and bernoulli. Use nn.Dropout / "
            "torch.bernoulli, or draw the tensor outside the model and pass it as an input")


def _where(node: fx.Node) -> str:
    """`` in module 'x.y' (Class)`` from the trace's module stack, when it has one."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls_name = getattr(cls, "__name__", str(cls)).rsplit(".", 1)[-1]
    return f" in module '{path}' ({cls_name})"


def _warn_unsupported(nodes: list[Node]) -> tuple[str, ...]:
    """One warning per op without a signature that the program really uses."""
    names = tuple(dict.fromkeys(n.op for n in nodes if n.sig is not None
                                and n.sig.kind == "replicated"))
    for name in names:
        warnings.warn(f"meshplan: no dimension signature for aten op '{name}'; it is planned "
                      "replicated (every operand gathered, computed on every device)",
                      stacklevel=3)
    return names


def _item_node(node: fx.Node, alias: dict[str, str], grad: dict[str, bool]) -> Node:
    """One output of a multi-output op, over all of the op's tensor operands."""
    parent = node.args[0]
    operands = _tensor_args(parent)
    names = [alias[o.name] for o in operands]
    call = OpCall(_packet(parent.target), tuple(_info(o.meta["val"]).shape for o in operands),
                  _info(node.meta["val"]).shape, tuple(parent.args), tuple(parent.kwargs.items()))
    _check_supported(parent, call.target)
    return _op_node(node, names, call, any(grad.get(n, False) for n in names), parent.target)


def _prune_dead(nodes: list[Node], loss: str) -> list[Node]:
    live = {loss}
    for n in reversed(nodes):
        if n.name in live:
            live.update(n.inputs)
    return [n for n in nodes if n.name in live or n.role == "param"]


def graph_signature_check(graph: Graph) -> None:
    """IR checker: every op's signature has one dims entry per operand and matching ranks."""
    for n in graph.nodes:
        if n.sig is None:
            continue
        sig: Signature = n.sig
        assert len(sig.inputs) == len(n.inputs), (n.name, sig, n.inputs)
        for dims, inp in zip(sig.inputs, n.inputs):
            assert len(dims) == len(graph.by_name[inp].out.shape), (n.name, dims, inp)
        assert len(sig.output) == len(n.out.shape), (n.name, sig.output, n.out.shape)


def capture(model: torch.nn.Module, loss_fn: Any, example_batch: Any) -> tuple[Traced, Graph]:
    """Trace and convert: the capture pass's front door."""
    from meshplan.capture.trace import trace
    traced = trace(model, loss_fn, example_batch)
    graph = to_ir(traced)
    graph_signature_check(graph)
    return traced, graph
