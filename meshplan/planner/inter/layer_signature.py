"""A layer's structure as a fingerprint: equal for identical layers, whatever their node names.

The inter-op planner profiles (or models) the cost of a stage made of consecutive layers and
caches it on the tuple of their signatures, so a GPT's identical blocks are costed once. The
signature covers, for each node of the layer in order: its role, op, output shape and dtype,
FLOPs, dimension signature, and where each operand comes from — a node of the same layer by
position, or an outside value by first-seen index with its role, shape and dtype. It also
covers which of the layer's values later layers read (what the stage must send on). Node names
never enter it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from meshplan.ir.graph import Graph, Node
from meshplan.ir.signatures import canonical_text
from meshplan.planner.inter.clustering import Layering


def _operand(graph: Graph, name: str, local: dict[str, int], outside: dict[str, int]
             ) -> tuple[Any, ...]:
    if name in local:
        return ("local", local[name])
    src = graph.by_name[name]
    return ("outside", outside.setdefault(name, len(outside)), src.role, src.out.shape,
            src.out.dtype)


def _node_key(graph: Graph, node: Node, local: dict[str, int], outside: dict[str, int]
              ) -> tuple[Any, ...]:
    operands = tuple(_operand(graph, x, local, outside) for x in node.inputs)
    return (node.role, node.op, node.out.shape, node.out.dtype, node.flops,
            canonical_text(node.sig), operands)


def layer_signature(graph: Graph, layering: Layering, index: int) -> str:
    """A 16-hex-digit fingerprint of layer ``index``'s structure (module docstring).

    Stable across processes (a hash of canonical text). Raises ValueError if ``index`` is not
    in [0, num_layers).
    """
    if not 0 <= index < layering.num_layers:
        raise ValueError(f"index={index!r}: must be in [0, {layering.num_layers})")
    names = layering.layers[index]
    local = {name: pos for pos, name in enumerate(names)}
    outside: dict[str, int] = {}
    nodes = tuple(_node_key(graph, graph.by_name[name], local, outside) for name in names)
    sent = tuple(pos for pos, name in enumerate(names)
                 if any(layering.layer_of[u] > index for u in graph.users[name]))
    text = repr((nodes, sent))
    return hashlib.sha1(text.encode()).hexdigest()[:16]
