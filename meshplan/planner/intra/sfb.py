"""Sufficient-factor broadcasting (HAP §2.5.2): a weight's gradient computed whole on every
device from gathered factors, instead of computed in pieces and all-reduced.

A matmul ``y = a·w`` whose batch is split over devices that each hold ``w`` whole leaves every
device a partial ``dW = a_iᵀ·dy_i``, which data parallelism all-reduces: ``2(n−1)/n·|w|`` moved.
The two factors suffice: all-gathered over the batch (``(n−1)/n·(|a| + |y|)``), they let every
device compute ``dW = aᵀ·dy`` over the whole batch, and nothing is synchronized after. It pays
when the batch is small against the weight. Its price is the ``dW`` product over the whole batch
on every device, which weighs most on a mixed cluster's slow devices, whose share of the batch
is small — so the planner decides it per weight, with the ratios, as one more update mode
(``"sfb"``) of the parameter.

A parameter can be updated this way when it is read, through views only, by exactly one
contraction of `SFB_OPS` whose dims each carry one atom (the weight gradient is then one
einsum of the activation and the output gradient, `SfbUse.equation`), and that contraction keeps
the weight whole while dividing its batch over every axis the weight is replicated on.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from meshplan.ir.graph import Graph, Node
from meshplan.planner.intra.layout import Layout
from meshplan.planner.intra.reshard import Step, reshard

SFB_OPS = frozenset({"mm", "bmm"})


@dataclass(frozen=True)
class SfbUse:
    """How a parameter's gradient is computed under SFB: ``consumer`` reads a view of it as
    operand ``weight``, and the activation factor as operand ``activation``; ``equation`` is
    the einsum (activation, output gradient) -> gradient of the weight operand."""

    consumer: str
    weight: int
    activation: int
    equation: str


def sfb_uses(graph: Graph) -> dict[str, SfbUse]:
    """The parameters SFB can update, each with its one use (module docstring)."""
    uses: dict[str, list[tuple[Node, int]]] = {}
    root: dict[str, str] = {}
    for node in graph.nodes:
        if node.role == "param":
            root[node.name] = node.name
            uses[node.name] = []
            continue
        for j, name in enumerate(node.inputs):
            if name not in root:
                continue
            through_view = (node.sig is not None and node.sig.kind == "view"
                            and len(node.inputs) == 1)
            if through_view:
                root[node.name] = root[name]
            else:
                uses[root[name]].append((node, j))
    out = {}
    for param, found in uses.items():
        if len(found) == 1 and graph.by_name[param].requires_grad:
            node, j = found[0]
            equation = _equation(node, j)
            if equation is not None:
                out[param] = SfbUse(node.name, j, 1 - j, equation)
    return out


def _equation(node: Node, j: int) -> str | None:
    """The weight-gradient einsum of ``node``'s operand ``j``, or None when SFB does not apply
    (another op, a dim of several atoms, an atom einsum cannot name)."""
    if node.op not in SFB_OPS or node.sig is None or node.sig.kind != "contraction" \
            or len(node.inputs) != 2:
        return None
    dims = (*node.sig.inputs, node.sig.output)
    if any(len(d) != 1 for spec in dims for d in spec):
        return None
    atoms = list(dict.fromkeys(d[0] for spec in dims for d in spec))
    if len(atoms) > len(string.ascii_letters):
        return None
    letter = dict(zip(atoms, string.ascii_letters))

    def word(spec: tuple[tuple[str, ...], ...]) -> str:
        return "".join(letter[d[0]] for d in spec)

    act, weight, out = node.sig.inputs[1 - j], node.sig.inputs[j], node.sig.output
    return f"{word(act)},{word(out)}->{word(weight)}"


def factor_gathers(activation: Layout, activation_bytes: int, output: Layout,
                   output_bytes: int, mesh_shape: tuple[int, ...]) -> tuple[Step, ...]:
    """The all-gathers (one backward's) of an SFB weight's factors: the consumer's activation
    and its output gradient, each made whole."""
    return (gather_steps(activation, activation_bytes, mesh_shape)
            + gather_steps(output, output_bytes, mesh_shape))


def gather_steps(layout: Layout, nbytes: int, mesh_shape: tuple[int, ...]) -> tuple[Step, ...]:
    """The all-gathers that make a value of ``layout`` whole on every device (a factor)."""
    return reshard(Layout(layout.dims), Layout.replicated(len(layout.dims)), nbytes,
                   mesh_shape).steps


def applies(weight_layout: Layout, sync_axes: tuple[int, ...], dp: tuple[int, ...],
            moves: bool) -> bool:
    """Whether the consumer's strategy lets SFB compute the gradient: the weight operand is
    whole (``weight_layout`` replicated, not resharded: ``moves`` False) and the consumer's
    batch is divided over exactly the weight's replicated axes ``dp`` (its gradient is partial
    over ``sync_axes`` == ``dp``)."""
    return (not moves and not weight_layout.split_axes and not weight_layout.partial
            and bool(sync_axes) and tuple(sorted(sync_axes)) == tuple(sorted(dp)))
