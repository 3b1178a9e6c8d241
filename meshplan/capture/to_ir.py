"""Turn a traced fx graph into meshplan's IR (`meshplan.ir.graph.Graph`).

Each fx call becomes one IR node with its normalized op name, signature, FLOPs and bytes.
Multi-output ops are represented by their first output (``getitem(op, 0)`` folds into the op);
the other outputs (layer norm's statistics, attention's log-sum-exp) only feed the backward pass,
which autograd derives at run time. An op without a rule is planned replicated, with one warning
naming it: it never aborts the plan.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
from torch import fx

from meshplan.capture.signature_rules import CONSTANT_OPS, LIKE_OPS, RULES, OpCall
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


# Multi-output ops whose outputs the forward program uses one by one: each used output is an
# IR node of its own (lowering calls the op and takes that output).
ITEM_OPS = ("split", "split_with_sizes", "max", "min")


def _is_split_item(node: fx.Node) -> bool:
    return (node.target is operator.getitem
            and _packet(node.args[0].target) in ITEM_OPS)


def _is_first_output(node: fx.Node) -> bool:
    return node.target is operator.getitem and node.args[1] == 0 and not _is_split_item(node)


def _opcall(node: fx.Node, operands: list[fx.Node], packet: str) -> OpCall:
    return OpCall(packet, tuple(_info(o.meta["val"]).shape for o in operands),
                  _info(node.meta["val"]).shape, tuple(node.args), tuple(node.kwargs.items()))


def _op_node(node: fx.Node, operands: list[str], op_call: OpCall, requires_grad: bool) -> Node:
    packet = op_call.target
    out = _info(node.meta["val"])
    rule = RULES.get(packet)
    r = rule(op_call) if rule is not None else None
    if r is None:
        sig = replicated_signature(tuple(len(s) for s in op_call.in_shapes), len(out.shape))
        name, flops = packet, float(out.numel)
    else:
        sig, name, flops = r.sig, r.name, r.flops
    in_bytes = sum(TensorInfo(s, out.dtype).nbytes for s in op_call.in_shapes)
    differentiable = out.dtype.startswith(("float", "bfloat", "complex"))
    return Node(node.name, "op", name, tuple(operands), out, sig, flops, in_bytes + out.nbytes,
                requires_grad and differentiable)


def to_ir(traced: Traced) -> Graph:
    """Build the IR graph of a traced program (see the module docstring)."""
    alias: dict[str, str] = {}
    nodes: list[Node] = []
    grad: dict[str, bool] = {}
    placeholders = iter(traced.placeholders)
    loss = None
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            role, state_name = next(placeholders)
            nodes.append(Node(node.name, role, role, (), _info(node.meta["val"]), None,
                              requires_grad=role == "param", state_name=state_name))
        elif node.op == "output":
            out = node.args[0]
            loss = alias.get((out[0] if isinstance(out, (list, tuple)) else out).name)
        elif _is_first_output(node):
            alias[node.name] = alias[node.args[0].name]
        elif _is_split_item(node):
            nodes.append(_split_item(node, alias, grad))
        elif node.target is operator.getitem:
            pass  # secondary outputs feed only the backward pass
        else:
            packet = _packet(node.target)
            operands = _tensor_args(node)
            names = [alias[o.name] for o in operands]
            if (not operands and packet in CONSTANT_OPS) or packet in LIKE_OPS:
                nodes.append(Node(node.name, "constant", packet, (), _info(node.meta["val"]),
                                  None))
            elif packet in ITEM_OPS and isinstance(node.meta.get("val"), (tuple, list)):
                pass  # represented by its getitem users
            else:
                rg = any(grad.get(n, False) for n in names)
                nodes.append(_op_node(node, names, _opcall(node, operands, packet), rg))
        if nodes and nodes[-1].name == node.name:
            alias[node.name] = node.name
            grad[node.name] = nodes[-1].requires_grad
    _check_used_outputs(nodes, traced)
    assert loss is not None, "traced graph has no output"
    live = _prune_dead(nodes, loss)
    return Graph(tuple(live), loss, _warn_unsupported(live))


def _warn_unsupported(nodes: list[Node]) -> tuple[str, ...]:
    """One warning per op without a signature that the program really uses."""
    names = tuple(dict.fromkeys(n.op for n in nodes if n.sig is not None
                                and n.sig.kind == "replicated"))
    for name in names:
        warnings.warn(f"meshplan: no dimension signature for aten op '{name}'; it is planned "
                      "replicated (every operand gathered, computed on every device)",
                      stacklevel=3)
    return names


def _split_item(node: fx.Node, alias: dict[str, str], grad: dict[str, bool]) -> Node:
    parent = node.args[0]
    src = parent.args[0]
    call = OpCall(_packet(parent.target), (_info(src.meta["val"]).shape,),
                  _info(node.meta["val"]).shape, tuple(parent.args), tuple(parent.kwargs.items()))
    return _op_node(node, [alias[src.name]], call, grad.get(alias[src.name], False))


def _check_used_outputs(nodes: list[Node], traced: Traced) -> None:
    # A forward op reading a secondary output (e.g. layer norm's mean) is outside the IR's model.
    for node in traced.graph_module.graph.nodes:
        if node.target is operator.getitem and node.args[1] != 0 and node.users:
            parent = _packet(node.args[0].target)
            if parent not in ITEM_OPS:
                raise ValueError(f"the forward program uses output {node.args[1]} of '{parent}', "
                                 "which meshplan cannot shard yet")


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
