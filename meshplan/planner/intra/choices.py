"""The choices of every node of a graph: roots with their own strategies, followers merged in.

Contractions, sources (parameters, inputs) and replicated ops are *roots*: each gets a list of
choices and, in the ILP, one decision. Every other op *follows* its main operand, so its choice
at index p is derived from its root's choice p (Alpa's follower merging). A parameter's choice is
its layout *and* its update mode (replicated, ZeRO-2, ZeRO-3, or SFB where it applies,
`sfb.py`): the update mode is a strategy.

`resolve_choices` applies the planning options (forced data parallelism, the batch dim pinned to a
mesh axis, tensor parallelism on one axis, forced update modes) by restricting root choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from meshplan.ir.graph import Graph, Node
from meshplan.planner.intra.layout import Axes, Layout, active_axes
from meshplan.planner.intra.sfb import sfb_uses
from meshplan.planner.intra.strategies import (Strategy, enumerate_strategies, follow,
                                               replicated_strategy, source_layouts)

UPDATE_MODES = ("replicated", "zero2", "zero3")
SFB_CHOICES = ("off", "auto", "force")


@dataclass(frozen=True)
class IntraOptions:
    """Options of the intra-operator pass (Alpa's, plus update modes).

    ``force_data_parallel``: batch split over every device, parameters replicated.
    ``force_batch_axis``: the batch dim of every op is split over this mesh axis (ignored if the
    axis has one device). ``tensor_axis``: batch dims may not use this axis (Megatron-style: data
    parallel on the other axis, tensor parallel on this one). ``update_mode``: force this mode on
    every parameter that has a data-parallel axis. ``prefer_reduce_scatter`` = ZeRO-2 updates.
    ``memory_budget``: bytes per device, None for no limit. ``include_compute``: add roofline
    compute time to the objective (off when α/β are abstract units, as in Alpa).
    ``full_split``: contractions never replicate work over an active axis (default: when
    compute is left out). ``share_blocks``: repeated blocks share their decisions.
    ``replicated_updates``: parameters (node names) updated replicated whatever the budget: one
    that several pipeline stages share, whose gradient is summed across them whole.
    ``sfb``: sufficient-factor broadcasting (`sfb.py`) for the weights it applies to: "off",
    "auto" (one more update mode of a weight kept whole, which the search weighs) or "force"
    (every weight it applies to is kept whole and updated so).
    ``tensor_weights``: every parameter of two or more dims is split over ``tensor_axis``
    where some even split allows it, as Megatron-LM keeps its weights (without it, splitting
    the sequence over that axis with the weights replicated is also tensor-axis work).
    ``hold_half_copies``: under mixed precision each parameter's half-type copy is made once
    per step and held through it (`runtime/step_casts.py`); off, every micro-batch and replay
    casts again and holds none (what `api.plan` falls back to when the copies do not fit).
    """

    force_data_parallel: bool = False
    force_batch_axis: int | None = None
    tensor_axis: int | None = None
    update_mode: str | None = None
    prefer_reduce_scatter: bool = False
    memory_budget: float | None = None
    include_compute: bool = True
    full_split: bool | None = None
    share_blocks: bool = True
    optimizer: str = "adamw"
    replicated_updates: frozenset[str] = frozenset()
    sfb: str = "off"
    tensor_weights: bool = False
    hold_half_copies: bool = True

    @property
    def heavy_full_split(self) -> bool:
        """Whether contractions must divide their work over every active axis (Alpa's rule when
        compute is left out; also what the hand-style methods mean by data/tensor parallel)."""
        return (not self.include_compute) if self.full_split is None else self.full_split

    @property
    def grows_with_batch(self) -> bool:
        """Whether every strategy open to a batch is open to one k times larger (splits that
        divide it divide k times it): no option forces a split the batch may not allow, with
        a fallback the larger batch would not take."""
        return not (self.force_data_parallel or self.heavy_full_split or self.tensor_weights
                    or self.force_batch_axis is not None or self.tensor_axis is not None)

    def __post_init__(self) -> None:
        if self.update_mode is not None and self.update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.sfb not in SFB_CHOICES:
            raise ValueError(f"sfb must be one of {SFB_CHOICES}, got {self.sfb!r}")
        for name in ("force_batch_axis", "tensor_axis"):
            v = getattr(self, name)
            if v is not None and v not in (0, 1):
                raise ValueError(f"{name} must be a mesh axis, 0 or 1; got {v!r}")


@dataclass(frozen=True)
class Choice:
    """What a node does at one index of its root: a strategy, and an update mode for params."""

    strategy: Strategy
    mode: str | None = None


@dataclass
class NodeChoices:
    """Roots, followers and the per-index choices of every node of one graph on one mesh."""

    graph: Graph
    mesh_shape: tuple[int, int]
    root_of: dict[str, str] = field(default_factory=dict)
    main_of: dict[str, int] = field(default_factory=dict)
    choices: dict[str, list[Choice]] = field(default_factory=dict)
    batch_dims: dict[str, frozenset[int]] = field(default_factory=dict)

    @property
    def roots(self) -> list[str]:
        return [n.name for n in self.graph.nodes if self.root_of[n.name] == n.name]


def is_root(node: Node) -> bool:
    return node.is_source or node.sig is None or node.sig.kind in ("contraction", "replicated",
                                                                    "random")


def main_operand(node: Node, graph: Graph) -> int:
    """The operand a follower takes its layout from: of full rank, carrying a gradient (an
    activation rather than a constant or a random mask), not a source, largest, latest. A
    reduction's is what it reduces, whatever its rank (an NLL per row follows its
    log-probabilities, not its targets of the output's rank)."""
    reduces = node.sig is not None and node.sig.kind == "reduction"
    best, key = 0, None
    for i, name in enumerate(node.inputs):
        inp = graph.by_name[name]
        k = (not reduces and len(inp.out.shape) == len(node.out.shape), inp.requires_grad,
             not inp.is_source, inp.out.numel, i)
        if key is None or k > key:
            best, key = i, k
    return best


def _input_batch_dims(node: Node) -> frozenset[int]:
    """The dims of a source that carry the batch: an input's or the target's own
    (`Node.batch_dims`, else dim 0); none for others."""
    if node.role not in ("input", "target") or not node.out.shape:
        return frozenset()
    return frozenset(node.batch_dims) if node.batch_dims is not None else frozenset({0})


def batch_dims(graph: Graph) -> dict[str, frozenset[int]]:
    """Which dims of each value carry the batch (dim 0 of inputs and target, or an input's own
    ``batch_dims``, propagated)."""
    out: dict[str, frozenset[int]] = {}
    for n in graph.nodes:
        if n.role in ("input", "target"):
            out[n.name] = _input_batch_dims(n)
        elif n.is_source or n.sig is None:
            out[n.name] = frozenset()
        else:
            atoms = {dims[d][0] for dims, name in zip(n.sig.inputs, n.inputs)
                     for d in out[name] if dims[d]}
            out[n.name] = frozenset(d for d, dims in enumerate(n.sig.output)
                                    if dims and dims[0] in atoms)
    return out


def op_batch_atoms(node: Node, bdims: Mapping[str, frozenset[int]]) -> set[str]:
    """The atoms of ``node``'s signature that carry the batch in its operands (`batch_dims`)."""
    return {dims[d][0] for dims, name in zip(node.sig.inputs, node.inputs)
            for d in bdims[name] if dims[d]}


def _allowed(assign: dict[str, Axes], batch_atoms: set[str], axes: Axes, opts: IntraOptions
             ) -> bool:
    """Whether an atom->axes assignment respects the batch options."""
    on_batch = {a for atom, ax in assign.items() if atom in batch_atoms for a in ax}
    if not batch_atoms:
        return True
    if opts.force_data_parallel:
        return on_batch == set(axes)
    if opts.force_batch_axis is not None and opts.force_batch_axis in axes:
        if opts.force_batch_axis not in on_batch:
            return False
    if opts.tensor_axis is not None and opts.tensor_axis in on_batch:
        return False
    return True


def _op_choices(node: Node, axes: Axes, mesh_shape: tuple[int, int], opts: IntraOptions,
                bdims: dict[str, frozenset[int]]) -> list[Choice]:
    if node.sig.kind in ("replicated", "random"):
        return [Choice(replicated_strategy(node.sig))]
    full = opts.heavy_full_split
    batch_atoms = op_batch_atoms(node, bdims)
    for full_split in ((True, False) if full else (False,)):
        strategies = [s for s in enumerate_strategies(node.sig, axes, mesh_shape,
                                                      full_split=full_split)
                      if _allowed(dict(s.assign), batch_atoms, axes, opts)]
        if strategies:
            return [Choice(s) for s in strategies]
    return [Choice(replicated_strategy(node.sig))]


def _source_strategy(layout: Layout) -> Strategy:
    return Strategy((), (), layout, ())


def _source_choices(node: Node, axes: Axes, mesh_shape: tuple[int, int], opts: IntraOptions,
                    sfb: bool = False) -> list[Choice]:
    """A source's layouts; a parameter's with its update modes (``sfb``: SFB applies to it)."""
    shape = node.out.shape
    if node.role == "constant" or not axes:
        layouts = [Layout.replicated(len(shape))]
    else:
        layouts = source_layouts(len(shape), shape, axes, mesh_shape)
    batched = _input_batch_dims(node)
    if batched:   # split along the batch as the options say, nothing else
        layouts = [l for l in layouts
                   if _allowed({"b": tuple(a for d in batched for a in l.dims[d])}, {"b"},
                               axes, opts)
                   and not any(ax for d, ax in enumerate(l.dims) if d not in batched)] \
            or layouts
    if node.role != "param":
        return [Choice(_source_strategy(l)) for l in layouts]
    if opts.force_data_parallel:
        layouts = [l for l in layouts if not l.split_axes]
    # A parameter is split only into equal pieces (as Megatron pads its vocabulary): the plan's
    # one list of collectives then holds on every rank, whose update buckets carry its pieces.
    layouts = [l for l in layouts if all(n % math.prod(mesh_shape[a] for a in ax) == 0
                                         for n, ax in zip(shape, l.dims))]
    t = opts.tensor_axis
    if opts.tensor_weights and t is not None and t in axes and len(shape) >= 2:
        layouts = [l for l in layouts if t in l.split_axes] or layouts
    sfb = sfb and bool(axes) and node.name not in opts.replicated_updates
    if sfb and opts.sfb == "force":   # kept whole, its gradient from the gathered factors
        return [Choice(_source_strategy(Layout.replicated(len(shape))), "sfb")]
    out = []
    for lay in layouts:
        modes = ["replicated"] if node.name in opts.replicated_updates else \
            param_modes(lay, shape, axes, mesh_shape, opts)
        if sfb and not lay.split_axes:
            modes = [*modes, "sfb"]
        for mode in modes:
            out.append(Choice(_source_strategy(lay), mode))
    return out


def param_modes(layout: Layout, shape: Sequence[int], axes: Axes, mesh_shape: tuple[int, int],
                opts: IntraOptions) -> list[str]:
    """Update modes open to a parameter in ``layout``: ZeRO needs a replicated axis to shard over."""
    dp = [a for a in axes if a not in layout.split_axes]
    group = 1
    for a in dp:
        group *= mesh_shape[a]
    local0 = shape[0] // max(1, _split_of(layout, 0, mesh_shape)) if shape else 0
    can_shard = group > 1 and local0 >= group
    forced = opts.update_mode or ("zero2" if opts.prefer_reduce_scatter else None)
    if forced and forced != "replicated" and can_shard:
        return [forced]
    if forced:
        return ["replicated"]
    if opts.memory_budget is None or not can_shard:
        return ["replicated"]  # without a memory limit, ZeRO only adds latency
    return list(UPDATE_MODES)


def _split_of(layout: Layout, dim: int, mesh_shape: tuple[int, int]) -> int:
    n = 1
    for a in layout.dims[dim]:
        n *= mesh_shape[a]
    return n


def resolve_choices(graph: Graph, mesh_shape: tuple[int, int], opts: IntraOptions) -> NodeChoices:
    """Roots' choices from signatures and options; followers' choices derived from their root."""
    axes = active_axes(mesh_shape)
    nc = NodeChoices(graph, mesh_shape, batch_dims=batch_dims(graph))
    sfb = sfb_uses(graph) if opts.sfb != "off" else {}
    for node in graph.nodes:
        if is_root(node):
            nc.root_of[node.name] = node.name
            nc.choices[node.name] = (_source_choices(node, axes, mesh_shape, opts,
                                                     node.name in sfb)
                                     if node.is_source else
                                     _op_choices(node, axes, mesh_shape, opts, nc.batch_dims))
            continue
        main = main_operand(node, graph)
        producer = node.inputs[main]
        nc.main_of[node.name] = main
        nc.root_of[node.name] = nc.root_of[producer]
        nc.choices[node.name] = [
            Choice(follow(node.sig, main, c.strategy.output, mesh_shape))
            for c in nc.choices[producer]]
    return nc
