"""Undo the flattening of batched matmuls (``q @ kᵀ`` over (batch, heads, s, d)).

``torch.matmul`` on operands with several batch dims reaches aten as views that merge the batch
dims into one, a 3-D ``bmm``, and a view that splits them again. In the IR a merged dim can only
be split by its leading atom, so the flattened form forbids the plan Megatron-LM runs — batch
over one mesh axis and heads over another — and the planner pays for gathering q, k and v
instead. This pass folds each such ``view → bmm → view`` back into one ``aten.matmul`` over the
unmerged operands, whose signature keeps every batch dim its own (``signature_rules.matmul_rule``);
the runtime calls ``aten.matmul`` on the local pieces, and autograd differentiates it as usual.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _unmerged(view: object, batch: tuple[int, ...]) -> Node | None:
    """The operand before ``view`` when ``view`` only merged ``batch`` into bmm's first dim."""
    if not isinstance(view, Node) or view.target not in _VIEWS or len(view.users) != 1:
        return None
    src = view.args[0]
    shape, flat = _shape(src), _shape(view)
    if shape is None or flat is None or len(shape) != len(batch) + 2:
        return None
    return src if shape[:-2] == batch and shape[-2:] == flat[1:] else None


def fold_batched_matmuls(gm: GraphModule) -> dict[str, str]:
    """Rewrite every ``view(a) bmm view(b) → view`` that flattened several batch dims into
    ``aten.matmul(a, b)`` in place; returns each removed node's name -> the node that holds
    its value (or its base) now."""
    renames: dict[str, str] = {}
    for bmm in list(gm.graph.nodes):
        if bmm.target is not aten.bmm.default or len(bmm.users) != 1:
            continue
        (out_view,) = bmm.users
        out = _shape(out_view)
        if out_view.target not in _VIEWS or out is None or len(out) < 4:
            continue  # one batch dim: bmm already says everything
        batch = out[:-2]
        if math.prod(batch) != _shape(bmm)[0] or out[-2:] != _shape(bmm)[1:]:
            continue
        a, b = (_unmerged(v, batch) for v in bmm.args[:2])
        if a is None or b is None:
            continue
        with gm.graph.inserting_before(out_view):
            folded = gm.graph.call_function(aten.matmul.default, (a, b))
        folded.meta.update(out_view.meta)
        out_view.replace_all_uses_with(folded)
        renames.update({out_view.name: folded.name, bmm.name: folded.name,
                        bmm.args[0].name: a.name, bmm.args[1].name: b.name})
        for dead in (out_view, bmm, *bmm.args[:2]):
            gm.graph.erase_node(dead)
    if renames:
        gm.graph.lint()
        gm.recompile()
    return renames
