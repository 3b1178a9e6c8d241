"""Merge repeated pure computations of a traced program (common subexpression elimination).

A module that applies three Linear layers to one input traces three identical views of it; left
apart they are three values, each moved and synchronized on its own. Merged, the value has three
consumers, and the planner moves it, and all-reduces its gradient, once (`planner/intra/fanout`).
Random draws and ops that mutate an operand are never merged: two draws differ, and a mutation
is a side effect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops


def _is_impure(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    tags = getattr(target, "tags", ())
    return (schema is not None and schema.is_mutable) or torch.Tag.nondeterministic_seeded in tags


def merge_common_subexpressions(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with repeated pure calls merged (node names and metadata kept)."""
    banned = set(get_CSE_banned_ops())
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_impure(node.target):
            banned.add(getattr(node.target, "overloadpacket", node.target))
    return CSEPass(banned_ops=banned)(gm).graph_module
