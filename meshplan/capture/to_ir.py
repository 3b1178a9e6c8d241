"""Turn a traced fx graph into meshplan's IR (`meshplan.ir.graph.Graph`).

Each fx call becomes one IR node with its normalized op name, signature, FLOPs and bytes.
A multi-output op whose other outputs only feed the backward pass (layer norm's statistics,
attention's log-sum-exp) is represented by its first output (``getitem(op, 0)`` folds into the
op). When the forward reads outputs apart (topk's indices, split's pieces), each used output is
an IR node of its own, over the op's operands. Tensor constants (fx ``get_attr``) and tensors
made from nothing (``arange``, ``new_ones``…) are constant nodes. An op without a rule, or whose
rule's signature does not fit, is planned replicated with one warning naming it: it never
aborts the plan.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any

import torch
from torch import fx

from meshplan.capture.signature_rules import CONSTANT_OPS, LIKE_OPS, RULES, OpCall, rule_for
from meshplan.capture.trace import HALF_BIAS, Traced
from meshplan.ir.graph import ALIASING_OPS, BUFFER_WRITE, Graph, Node, TensorInfo
from meshplan.ir.signatures import replicated_signature, signature_fits


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


# Ops whose split strategies lowering implements by hand for their first output (batch norm's
# statistics exchange, class-split NLL): their other outputs, when read, are planned replicated.
SPECIALLY_LOWERED = frozenset({"native_batch_norm", "nll_loss_forward", "native_dropout"})


def _outputs_used_apart(node: fx.Node) -> bool:
    """A multi-output op whose outputs the forward reads one by one: a list output (split,
    unbind, chunk) or any output but the first in use (topk's indices, var_mean's mean…)."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return False
    if isinstance(val, list):
        return True
    return any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users)


def _opcall(node: fx.Node, operands: list[fx.Node], packet: str, out_val: Any) -> OpCall:
    return OpCall(packet, tuple(_info(o.meta["val"]).shape for o in operands),
                  _info(out_val).shape, tuple(node.args), tuple(node.kwargs.items()),
                  tuple(_info(o.meta["val"]).dtype for o in operands), node.target)


def _op_node(name: str, operands: list[str], op_call: OpCall, out: TensorInfo,
             requires_grad: bool, signed: bool = True, half_bias: bool = False) -> Node:
    packet = op_call.target
    try:
        r = rule_for(op_call) if signed else None
    except Exception:  # noqa: BLE001 - a variant a rule does not handle: planned replicated
        r = None  # (DESIGN §3.3: what cannot be sharded is replicated, never a crash)
    if r is None or not signature_fits(r.sig, op_call.in_shapes, out.shape):
        sig = replicated_signature(tuple(len(s) for s in op_call.in_shapes), len(out.shape))
        op_name, flops = packet, float(out.numel)
    else:
        sig, op_name, flops = r.sig, r.name, r.flops
    in_bytes = sum(TensorInfo(s, d).nbytes for s, d in zip(op_call.in_shapes, op_call.in_dtypes))
    differentiable = out.dtype.startswith(("float", "bfloat", "complex"))
    return Node(name, "op", op_name, tuple(operands), out, sig, flops, in_bytes + out.nbytes,
                requires_grad and differentiable, half_bias=half_bias)


def _check_random(node: fx.Node, packet: str) -> None:
    """A random draw meshplan cannot make equal to one device's is refused, never planned: each
    rank drawing from its own generator would train silently differently."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags and packet not in RULES:
        raise ValueError(
            f"the program draws random numbers with '{packet}': meshplan reproduces one "
            "device's random draws only for dropout and bernoulli. Use nn.Dropout / "
            "torch.bernoulli, or draw the tensor outside the model and pass it in the batch")


def _constant(node: fx.Node, op: str) -> Node:
    return Node(node.name, "constant", op, (), _info(node.meta["val"]), None)


def to_ir(traced: Traced) -> Graph:
    """Build the IR graph of a traced program (see the module docstring)."""
    alias: dict[str, str] = {}
    nodes: list[Node] = []
    grad: dict[str, bool] = {}
    placeholders = iter(traced.placeholders)
    roles: dict[str, str] = {}
    loss = None
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            role, state_name = next(placeholders)
            roles[node.name] = role
            nodes.append(Node(node.name, role, role, (), _info(node.meta["val"]), None,
                              requires_grad=role == "param", state_name=state_name))
        elif node.op == "get_attr":  # a tensor constant of the program
            nodes.append(_constant(node, "tensor_constant"))
        elif node.op == "output":
            out = node.args[0]
            loss = alias.get((out[0] if isinstance(out, (list, tuple)) else out).name)
        elif node.target is operator.getitem:
            parent = node.args[0]
            if _outputs_used_apart(parent):
                if node.users:
                    nodes.append(_item_node(node, alias, grad))
            elif node.args[1] == 0 and parent.name in alias:
                alias[node.name] = alias[parent.name]
            # else: a secondary output that feeds only the backward pass
        elif node.target is torch.ops.aten.copy_.default and \
                roles.get(node.args[0].name) == "buffer":
            nodes.append(_buffer_write(node, alias))   # placed after its value, below
        elif not node.users:
            pass  # dead (an unused intermediate)
        elif _outputs_used_apart(node):
            pass  # represented by its getitem users
        else:
            packet = _packet(node.target)
            operands = _tensor_args(node)
            names = [alias[o.name] for o in operands]
            if (not operands and packet in CONSTANT_OPS) or packet in LIKE_OPS:
                nodes.append(_constant(node, packet))
            else:
                _check_random(node, packet)
                # A factory's tensor operands are values (eager's linspace has no gradient).
                rg = packet not in CONSTANT_OPS and packet != "detach" and \
                    any(grad.get(n, False) for n in names)
                nodes.append(_op_node(node.name, names,
                                      _opcall(node, operands, packet, node.meta["val"]),
                                      _info(node.meta["val"]), rg,
                                      half_bias=bool(node.meta.get(HALF_BIAS))))
        if nodes and nodes[-1].name == node.name:
            alias[node.name] = node.name
            grad[node.name] = nodes[-1].requires_grad
    if loss is None:
        raise AssertionError("meshplan internal error: the traced graph has no output")
    live = _prune_dead(_writes_after_values(nodes), loss)
    if traced.saved is not None:
        live = _mark_kept(live, {alias[n] for n in traced.saved if n in alias})
    return Graph(tuple(live), loss, _warn_unsupported(live))


def _mark_kept(nodes: list[Node], saved: set[str]) -> list[Node]:
    """Set every op and parameter node's ``kept``: true for the storage owners of the saved
    values (a saved view keeps its base; a ZeRO-3 parameter kept is gathered again in
    backward)."""
    by_name = {n.name: n for n in nodes}
    owners = set()
    for name in saved:
        while name in by_name and by_name[name].op in ALIASING_OPS and by_name[name].inputs:
            name = by_name[name].inputs[0]
        owners.add(name)
    return [dataclasses.replace(n, kept=n.name in owners and n.op not in ALIASING_OPS)
            if n.role in ("op", "param") else n for n in nodes]


def _warn_unsupported(nodes: list[Node]) -> tuple[str, ...]:
    """One warning per op without a signature that the program really uses."""
    names = tuple(dict.fromkeys(n.op for n in nodes if n.sig is not None
                                and n.sig.kind == "replicated" and n.op != BUFFER_WRITE))
    for name in names:
        warnings.warn(f"meshplan: no dimension signature for aten op '{name}'; it is planned "
                      "replicated (every operand gathered, computed on every device)",
                      stacklevel=3)
    return names


def _item_node(node: fx.Node, alias: dict[str, str], grad: dict[str, bool]) -> Node:
    """One used output of a multi-output op: an IR node over the op's operands, signed like
    the op for that output's shape (lowering re-runs the op locally and takes this output)."""
    parent = node.args[0]
    if _packet(parent.target) == "native_dropout" and node.args[1] != 0:
        # Lowering redraws dropout's mask per rank from the step's generator (so every split
        # equals one device); a second draw for the mask alone would not be the same mask.
        raise ValueError("the forward reads the mask of aten.native_dropout, which meshplan "
                         "cannot reproduce on split tensors; use only F.dropout's output (its "
                         "masks are reproduced exactly on every split)")
    operands = _tensor_args(parent)
    names = [alias[o.name] for o in operands]
    packet = _packet(parent.target)
    call = _opcall(parent, operands, packet, node.meta["val"])
    return _op_node(node.name, names, call, _info(node.meta["val"]),
                    any(grad.get(n, False) for n in names), packet not in SPECIALLY_LOWERED)


def _buffer_write(node: fx.Node, alias: dict[str, str]) -> Node:
    """The functionalized trace's ``copy_(buffer, value)``: the forward's update of a buffer
    (a running statistic, a counter), which the next step reads. Replicated: every rank holds
    its buffers whole and writes the whole value (`lower/local_ops.write_buffer`)."""
    buf, value = node.args[0], node.args[1]
    out = _info(buf.meta["val"])
    if not isinstance(value, fx.Node):
        raise ValueError(f"meshplan cannot plan the forward's write of a Python number into "
                         f"buffer {buf.name}; write a tensor (buffer.fill_(torch.tensor(x)))")
    sig = replicated_signature((len(out.shape), len(value.meta["val"].shape)), len(out.shape))
    return Node(node.name, "op", BUFFER_WRITE, (alias[buf.name], alias[value.name]), out, sig,
                float(out.numel), 2.0 * out.nbytes)


def _writes_after_values(nodes: list[Node]) -> list[Node]:
    """``nodes`` with each buffer write moved to right after its value (the trace puts the
    writes last): a layer's update stays in its layer, with the ops that read the buffer."""
    writes = [n for n in nodes if n.op == BUFFER_WRITE]
    if not writes:
        return nodes
    after: dict[str, list[Node]] = {}
    for w in writes:
        after.setdefault(w.inputs[1], []).append(w)
    out: list[Node] = []
    for n in nodes:
        if n.op != BUFFER_WRITE:
            out.append(n)
            out.extend(after.get(n.name, ()))
    return out


def _prune_dead(nodes: list[Node], loss: str) -> list[Node]:
    live = {loss} | {n.name for n in nodes if n.op == BUFFER_WRITE}
    for n in reversed(nodes):
        if n.name in live:
            live.update(n.inputs)
    return [n for n in nodes if n.name in live or n.role == "param"]


def graph_signature_check(graph: Graph) -> None:
    """IR checker: every op's signature fits its operands and output. `to_ir` replaces a rule's
    signature that does not fit by the replicated one, so a failure here is meshplan's bug."""
    for n in graph.nodes:
        if n.sig is None:
            continue
        shapes = tuple(graph.by_name[i].out.shape for i in n.inputs)
        if not signature_fits(n.sig, shapes, n.out.shape):
            raise AssertionError(f"meshplan internal error: the signature of {n.name} ({n.op}) "
                                 f"does not fit its operands {shapes} -> {n.out.shape}: {n.sig}")


def capture(model: torch.nn.Module, loss_fn: Any, example_batch: Any) -> tuple[Traced, Graph]:
    """Trace and convert: the capture pass's front door. Safe from several threads: see
    `meshplan.capture.memo` (emulated ranks share one capture of their shared model)."""
    from meshplan.capture.memo import captured_once
    return captured_once(model, loss_fn, example_batch, _capture_now)


def _capture_now(model: torch.nn.Module, loss_fn: Any, example_batch: Any
                 ) -> tuple[Traced, Graph]:
    from meshplan.capture.trace import trace
    # The training step's program, whatever the caller's grad mode: under torch.no_grad() (a
    # loop that evaluates before it trains) every value would trace as made without
    # gradients (`no_grad.py`), a program without its backward.
    with torch.enable_grad():
        traced = trace(model, loss_fn, example_batch)
    graph = to_ir(traced)
    graph_signature_check(graph)
    return traced, graph
