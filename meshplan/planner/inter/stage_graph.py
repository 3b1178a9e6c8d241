"""The program of one pipeline stage: layers [start, end) of a clustered graph, as a `Graph` the
intra-operator planner can cost on its own.

A stage holds its layers' ops and every source they read (a parameter tied across stages, like
GPT's embedding and LM head, appears in each stage that reads it). Op outputs of earlier layers
that it reads arrive from the previous stage: they become ``"input"`` sources (laid out however
the stage likes: the cross-mesh transfer delivers any layout) that keep ``requires_grad``, so
their gradient is sent back, and the dims that carry the batch in the whole program (an MoE
layer's dispatched tokens have their experts in dim 0, not the batch). Values it sends to
later stages are read by one ``stage_output`` sink each, an identity whose input may not be a
partial sum, so a stage pays for reducing what it sends, as the runtime must. The last
stage's loss stays the loss; another stage's loss is its last sink, which only tells the
planner where the program ends.

`structure_key` names a stage by its structure alone (ops, shapes, wiring; no node names), so
identical layer ranges of repeated blocks share one cost (Alpa's profiling reuse).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace

from meshplan.ir.graph import Graph, Node
from meshplan.ir.signatures import Signature, canonical_text, fresh_atoms
from meshplan.planner.inter.clustering import Layering

SINK_OP = "stage_output"


def stage_graph(graph: Graph, layering: Layering, start: int, end: int) -> Graph:
    """The program of layers ``[start, end)`` (module docstring). Raises ValueError for an
    empty or out-of-range span."""
    if not 0 <= start < end <= layering.num_layers:
        raise ValueError(f"a stage spans layers [start, end) with 0 <= start < end <= "
                         f"{layering.num_layers}; got [{start}, {end})")
    return cut_stage(graph, layering.layer_of, start, end)


def cut_stage(graph: Graph, where: Mapping[str, int], start: int, end: int) -> Graph:
    """`stage_graph` with the layer of every op given by ``where`` (op name -> layer)."""
    ops = [n for n in graph.nodes if n.role == "op" and start <= where[n.name] < end]
    inside = {n.name for n in ops}
    needed = {i for n in ops for i in n.inputs}
    nodes: list[Node] = []
    batched = _batch_dims(graph) if needed - inside else {}
    for n in graph.nodes:
        if n.name in inside:
            nodes.append(n)
        elif n.name in needed:
            nodes.append(n if n.is_source else _received(n, batched[n.name]))
    sinks = [_sink(graph.by_name[v]) for v in _sent(graph, inside, where, end)]
    loss = graph.loss if graph.loss in inside else sinks[-1].name
    return Graph(tuple(nodes) + tuple(sinks), loss, graph.unsupported_ops)


def _sent(graph: Graph, inside: set[str], where: Mapping[str, int], end: int) -> list[str]:
    """Values produced inside and read by an op of a later stage, in graph order."""
    return [n.name for n in graph.nodes if n.name in inside and n.name != graph.loss
            and any(where[u] >= end for u in graph.users[n.name]
                    if graph.by_name[u].role == "op")]


_BATCHED: list[tuple[Graph, dict[str, frozenset[int]]]] = []   # the last graph's


def _batch_dims(graph: Graph) -> dict[str, frozenset[int]]:
    """`choices.batch_dims` of ``graph``, kept for the graph last asked (a search cuts every
    range of one program)."""
    from meshplan.planner.intra.choices import batch_dims
    if not _BATCHED or _BATCHED[0][0] is not graph:
        _BATCHED[:] = [(graph, batch_dims(graph))]
    return _BATCHED[0][1]


def _received(node: Node, batched: frozenset[int]) -> Node:
    # Dim 0 is what an input carries the batch in unless told otherwise.
    dims = None if batched == ({0} if node.out.shape else frozenset()) else tuple(sorted(batched))
    return Node(node.name, "input", "input", (), node.out, None,
                requires_grad=node.requires_grad, batch_dims=dims)


def _sink(node: Node) -> Node:
    atoms = fresh_atoms(len(node.out.shape))
    sig = Signature((atoms,), atoms, "elementwise",
                    atom_sizes=tuple(zip(atoms, node.out.shape)))
    return Node(f"{node.name}__{SINK_OP}", "op", SINK_OP, (node.name,), node.out, sig,
                requires_grad=node.requires_grad)


def structure_key(graph: Graph) -> str:
    """A name-free fingerprint of ``graph``: equal for programs of the same ops, shapes, dtypes,
    signatures and wiring, whatever their nodes are called, and whatever order their sets
    were built in (`signatures.canonical_text`)."""
    index = {n.name: k for k, n in enumerate(graph.nodes)}
    lines = [f"{n.role}|{n.op}|{tuple(index[i] for i in n.inputs)}|{n.out.shape}|"
             f"{n.out.dtype}|{n.flops}|{n.requires_grad}|{canonical_text(n.sig)}"
             + ("" if n.batch_dims is None else f"|batch={n.batch_dims}") for n in graph.nodes]
    lines.append(f"loss={index[graph.loss]}")
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:16]


def renamed(graph: Graph, prefix: str) -> Graph:
    """``graph`` with every node name prefixed (tests: structure keys ignore names)."""
    def name(x: str) -> str:
        return prefix + x
    nodes = tuple(replace(n, name=name(n.name), inputs=tuple(name(i) for i in n.inputs))
                  for n in graph.nodes)
    return Graph(nodes, name(graph.loss), graph.unsupported_ops)
