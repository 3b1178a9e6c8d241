"""In-place ops that no other op can observe, made pure without functionalization's retrace.

A traced program that writes into a tensor is functionalized by tracing it once more
(`trace._make_fx`), which costs about as much as the first trace. One write is often all there
is, and harmless: Hugging Face's mask helpers shift a fresh ``arange`` by an offset in place
(``kv_arange += kv_offset``), so a Llama, Qwen2 or Gemma 2 trace carries one ``add_`` and was
traced twice (Llama-3-70B on meta: 5.9 s, 3.8 s without the retrace). When the written tensor is
an op's fresh result (no view of anything) that no other op reads, writing into it and computing
a new value are the same program, and the in-place op is replaced by its pure form
(``add_.Tensor`` -> ``add.Tensor``, ``bernoulli_.float`` -> ``bernoulli.p``: the overload of
the same arguments). Such writes may chain: dropout decomposed in a trace fills a fresh tensor
(``empty_like``) with ``bernoulli_`` and scales it with ``div_`` (GPT-2, BERT and T5 in
training mode, one chain per dropout), and once the first is pure its result is fresh too. A
trace with any other write is retraced as before.

The nodes are then named as the retrace names them (each op's name from its op, numbered in
order), so the program, its fingerprint and its saved values (`same_nodes`) are those of the
retraced one: plans made either way fit each other.
"""

from __future__ import annotations

import re

import torch
from torch.fx import Graph, GraphModule, Node

from meshplan.torch_api import OpOverload

aten = torch.ops.aten

# How fx splits a node's name into its base and number (``add_3``: ``add``, 3).
_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")


def pure_forms(writes: list[Node]) -> dict[Node, OpOverload] | None:
    """The pure overload of each node of ``writes`` (a trace's mutating nodes), or None unless
    every one is an in-place op no other op can observe (`_pure_form`): then no write is left
    and functionalization has nothing else to do."""
    forms: dict[Node, OpOverload | None] = {}
    for node in writes:   # in graph order: a write into a write made pure is into a fresh result
        forms[node] = _pure_form(node, forms)
    return None if any(f is None for f in forms.values()) else forms


def make_pure(gm: GraphModule, forms: dict[Node, OpOverload], saved: set[str]) -> set[str]:
    """Replace each in-place op of ``forms`` (`pure_forms`) by its pure form and rename the
    nodes as the retrace would (module docstring). Returns ``saved`` (the nodes autograd saves)
    as `same_nodes` maps them onto that retrace: a name now held by another op is dropped."""
    targets = {n.name: n.target for n in gm.graph.nodes if n.op != "placeholder"}
    for node, pure in forms.items():
        node.target = pure
    _rename_as_traced(gm)
    now = {n.name: n.target for n in gm.graph.nodes if n.op != "placeholder"}
    return {name for name in saved if name not in targets
            or (name in now and now[name] == targets[name])}


def _pure_form(node: Node, made_pure: dict[Node, OpOverload | None]) -> OpOverload | None:
    """The pure overload ``node``'s in-place op may be replaced by, or None: it writes only its
    first operand, which is a fresh result (of an op returning a new tensor, or of a write of
    ``made_pure`` with a pure form) that only ``node`` reads, and the pure op's result has the
    same shape and dtype (no type promotion the write would have undone). Called under the
    fake mode the graph was traced in: the result is checked on its fake values."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return None
    schema = target._schema
    if not schema.is_mutable or not node.args or not isinstance(node.args[0], Node):
        return None
    written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    if not written[0] or any(written[1:]):
        return None
    pure = _pure_overload(target)
    if pure is None:
        return None
    source = node.args[0]
    made = source.target
    fresh = made_pure.get(source) is not None or (
        isinstance(made, OpOverload)
        and not any(r.alias_info is not None for r in made._schema.returns))
    if source.op != "call_function" or not fresh or list(source.users) != [node]:
        return None
    return pure if _same_result(node, pure) else None


def _pure_overload(target: OpOverload) -> OpOverload | None:
    """The overload of the pure packet (``add`` for ``add_``) taking the same arguments as the
    in-place ``target``, aliasing aside: functionalization's own choice (``bernoulli_.float``
    -> ``bernoulli.p``); None if there is none."""
    name = target.overloadpacket.__name__
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    if packet is None:
        return None

    def arguments(op: OpOverload) -> list[tuple[str, str, bool]]:
        return [(a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments]

    same = getattr(packet, target._overloadname, None)
    candidates = ([same] if same is not None else []) + \
        [getattr(packet, o) for o in packet.overloads()]
    for pure in candidates:
        if not pure._schema.is_mutable and arguments(pure) == arguments(target):
            return pure
    return None


def _same_result(node: Node, pure: OpOverload) -> bool:
    def value(x: object) -> object:
        return x.meta.get("val") if isinstance(x, Node) else x
    try:
        out = pure(*(value(a) for a in node.args),
                   **{k: value(v) for k, v in node.kwargs.items()})
    except (RuntimeError, TypeError):
        return False
    was = node.meta.get("val")
    return isinstance(out, torch.Tensor) and isinstance(was, torch.Tensor) and \
        out.shape == was.shape and out.dtype == was.dtype


def _rename_as_traced(gm: GraphModule) -> None:
    """Name every op node as tracing names it: its op's name (an in-place op made pure: the pure
    op's), numbered in graph order by a fresh graph's namespace, into which the nodes are
    copied. Other nodes keep their names (placeholders, constants and the output are named by
    position, not by op)."""
    old = gm.graph
    fresh = Graph()
    fresh.set_codegen(old._codegen)   # make_fx's calling convention (flattened lists)
    copies: dict[Node, Node] = {}
    for node in old.nodes:
        if node.op == "call_function":   # the old graph is dropped: its names may change
            node.name = node.target.overloadpacket.__name__ \
                if isinstance(node.target, OpOverload) else _NUMBERED.match(node.name)[1]
        copies[node] = fresh.node_copy(node, copies.__getitem__)
    gm.graph = fresh
