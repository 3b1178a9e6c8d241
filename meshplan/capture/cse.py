"""Merge repeated pure computations of a traced program (common subexpression elimination).

A module that applies three Linear layers to one input traces three identical views of it; left
apart they are three values, each moved and synchronized on its own. Merged, the value has three
consumers, and the planner moves it, and all-reduces its gradient, once (`planner/intra/fanout`).
Random draws and ops that mutate an operand are never merged: two draws differ, and a mutation
is a side effect. Nor are calls that read no value (``arange(n)``, ``zeros(shape)``): a
constant costs the plan nothing, and whether two of them coincide depends on the sizes (the
positions and the batch rows of 8 sequences of 8 tokens), so merging them would make the
program's structure depend on the batch's shape, which a plan serves whatever its sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node


def _is_impure(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    tags = getattr(target, "tags", ())
    return (schema is not None and schema.is_mutable) or torch.Tag.nondeterministic_seeded in tags


def _key(value: Any) -> Any:
    """A hashable form of an fx argument (nodes by identity, lists as tuples); TypeError for
    what cannot be compared so."""
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, float):
        return (float, repr(value))   # -0.0 is not 0.0, and nan equals nan here
    hash(value)
    return (type(value), value)


def merge_common_subexpressions(gm: GraphModule) -> dict[str, str]:
    """Merge ``gm``'s repeated pure calls in place (the first of each kept, with its name and
    metadata); returns what was merged: name -> the name of the node now holding its value (so
    what capture learned about a merged node, e.g. that autograd saves it, follows it)."""
    seen: dict[Any, Node] = {}
    merged: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _is_impure(node.target) \
                or not node.all_input_nodes:
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except TypeError:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            merged[node.name] = first.name
            gm.graph.erase_node(node)
    if merged:
        gm.recompile()
    return merged
