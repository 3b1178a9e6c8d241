"""Lowering: a plan and a traced program -> one local fx program per rank.

The local program runs the traced aten ops on plain local tensors. Before each op, every operand
is resharded from its producer's layout to the layout the op's strategy needs, by exactly the
steps of `meshplan.planner.intra.reshard` (autograd-aware collectives from
`meshplan.runtime.collectives`). A few ops need local arguments: views and expands get the
rank's local shape; means over split dims become local sums divided by the global count, so their
result is a partial sum like any other split reduction.

The program's signature is ``(comm, rng, *params, *buffers, *inputs, target) -> local loss``
(a pipeline stage's program: its sources in graph order, values received from earlier stages
among them, returning ``(local loss or None, *values it sends)``);
``rng`` is the step's dropout generator (the same seed on every rank); for a parameter the
trainer passes its local compute tensor, for a ZeRO-3 parameter its shard, which the program
gathers right before its first use (`meshplan.runtime.zero3`: its gradient is reduce-scattered
in backward). Other parameter gradients are not synchronized here: the trainer does that once
per step, in buckets — except an SFB weight's, computed whole in backward from its gathered
factors (`meshplan.runtime.sfb`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from meshplan.capture.signature_rules import LIKE_OPS
from meshplan.capture.trace import Traced
from meshplan.cost.collectives import uneven_gather_impl
from meshplan.cost.mesh import LogicalMesh, with_shares
from meshplan.cost.precision import DTYPES, runs_half
from meshplan.ir.graph import BUFFER_WRITE, Graph, Node
from meshplan.lower import local_ops, microbatch
from meshplan.lower.grain import cut_units
from meshplan.lower.overlap import plan_units
from meshplan.lower.shards import (MeshPos, Sharded, cut, gathered, local_shape, op_output,
                                   piece_offsets, source_sharded, split_more, uneven,
                                   with_partial)
from meshplan.plan.plan import OpDecision, Plan
from meshplan.planner.inter.stage_graph import SINK_OP
from meshplan.planner.intra.formulate import param_roots
from meshplan.planner.intra.layout import Layout
from meshplan.planner.intra.reshard import Step, reshard
from meshplan.planner.intra.sfb import SfbUse, gather_steps, sfb_uses
from meshplan.runtime import collectives as C
from meshplan.runtime import sfb as sfb_runtime
from meshplan.runtime import zero3


@dataclass(frozen=True)
class LocalProgram:
    """One rank's program and the meaning of its placeholders (after ``comm``)."""

    graph_module: fx.GraphModule
    placeholders: tuple[tuple[str, str], ...]   # (role, state name / input name)
    values: dict[str, Sharded]                  # layout and piece sizes of every IR value
    loss_partial: tuple[int, ...]
    # A pipeline stage's program returns (loss or None, *sent) instead of the loss: the values
    # it sends to later stages, in its sinks' order; ``has_loss``: whether it computes the loss.
    sent: tuple[str, ...] = ()
    has_loss: bool = True
    # The loss's batch reductions scaled per micro-batch, in the order of their placeholders
    # (right after comm and rng; `lower/microbatch.py`).
    scaled: tuple[str, ...] = ()
    # Each local node's IR node (what it was lowered for): where layers are cut.
    owner: dict[str, str] = field(default_factory=dict)

    def split_output(self, out: object) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(local loss or None, values sent) of what the program returned."""
        if not self.sent:
            return out, ()   # type: ignore[return-value]
        loss, *sent = out    # type: ignore[misc]
        return loss, tuple(sent)


def _layout(spec: str, ndim: int) -> Layout:
    return Layout.parse(spec, ndim)


class _Lowerer:
    def __init__(self, traced: Traced, graph: Graph, plan: Plan, pos: MeshPos) -> None:
        self.traced, self.graph, self.plan, self.pos = traced, graph, plan, pos
        self.fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
        self.out = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.values: dict[str, Sharded] = {}
        self.param_root = param_roots(graph)
        self.sources = {s.node: s.spec for s in plan.sources}
        self.params = {p.node: p for p in plan.params}
        self.ops = {o.node: o for o in plan.ops}
        self.moved: dict[tuple, tuple[Sharded, fx.Node]] = {}
        self.scaled: frozenset[str] = frozenset()   # set by `run`
        # ZeRO-3 parameters not yet gathered, their units (`lower/overlap.py`), and the
        # gathered values.
        self.to_gather: set[str] = set()
        self.zero3_units = plan_units(plan, graph)[0]
        self.unit_of = {p: u for u, g in enumerate(self.zero3_units) for p in g.params}
        self.gathers: set[fx.Node] = set()
        self.constants: dict[str, torch.Tensor] = {}   # the program's tensor constants
        self.comm = self.out.placeholder("comm")
        # Under mixed precision the contractions run at the half type on every device (CPU
        # autocast leaves aten.convolution in fp32): cast explicitly, as the plan prices them.
        self.half = None if plan.dtype == "fp32" else getattr(torch, DTYPES[plan.dtype])
        self.rng = self.out.placeholder("rng")
        # Model segments (HAP §5.2): a node's rank position carries its segment's weights, so
        # what it cuts, it cuts by them (`_at`); operands cut by another segment's are re-cut.
        self.positions = [MeshPos(pos.shape, pos.rank, tuple(tuple(a) for a in w))
                          for w in plan.segment_weights] or [pos]
        self.segment_of = plan.segment_of if plan.segment_weights else {}
        # Cut units matter to uneven shards only (`shards.cut`).
        self.units = cut_units(graph) if any(uneven(p.weights) for p in self.positions) else {}
        # How uneven shards are gathered: the plan's choice per tensor, made again here by the
        # same rule on the same figures (`uneven_gather_impl`).
        self.meshes = [with_shares(LogicalMesh(plan.mesh_shape, plan.alpha, plan.beta),
                                   p.weights, plan.options.get("gather_impl", "auto"))
                       for p in self.positions]
        self._at(0)
        # Consumers of SFB weights -> how they compute the weight's gradient.
        self.sfb: dict[str, SfbUse] = {}
        if any(p.update == "sfb" for p in plan.params):
            self.sfb = {use.consumer: use for param, use in sfb_uses(graph).items()
                        if self.params[param].update == "sfb"}

    def _at(self, segment: int) -> None:
        """Lower the next node as one of ``segment``."""
        self.segment, self.pos, self.mesh = (segment, self.positions[segment],
                                             self.meshes[segment])

    def _units(self, name: str, ndim: int) -> tuple[int, ...]:
        return tuple(self.units.get((name, d), 1) for d in range(ndim))

    def _impl(self, s: Step) -> str:
        impl = uneven_gather_impl(self.mesh, s.axes, s.nbytes)
        return "padded" if impl == "ring" else impl

    def run(self, scaled: tuple[microbatch.BatchReduction, ...] = ()) -> LocalProgram:
        phs = [(n.role, n.state_name or n.name) for n in self.graph.nodes
               if n.is_source and n.role != "constant"]
        # Each of the loss's batch reductions times its micro-batch scale (`microbatch.py`):
        # placeholders right after comm and rng.
        scales = {r.node: self.out.placeholder(f"scale_{r.node}") for r in scaled}
        self.scaled = frozenset(scales)
        statistics = {r.node for r in scaled if r.statistic}
        owner: dict[str, str] = {}   # each local node -> the IR node it was lowered for
        for node in self.graph.nodes:
            self._at(self.segment_of.get(node.name, 0))
            before = len(self.out.nodes)
            if node.is_source:
                self._source(node)
            elif node.op == SINK_OP:
                self._sink(node)
            else:
                self._op(node)
                if node.name in statistics:
                    v = self.values[node.name]
                    zero = bool(v.layout.partial) and self.pos.index(v.layout.partial) != 0
                    self.env[node.name] = self.out.call_function(microbatch.whole_batch, (
                        self.env[node.name], scales[node.name], piece_offsets(v, self.pos),
                        zero))
                elif node.name in scales:
                    self.env[node.name] = self.out.call_function(
                        microbatch.scaled, (self.env[node.name], scales[node.name]))
            made = len(self.out.nodes) - before
            for fxn in reversed(self.out.nodes):
                if made == 0:
                    break
                owner[fxn.name] = node.name
                made -= 1
        sinks = [n for n in self.graph.nodes if n.op == SINK_OP]
        has_loss = self.graph.loss not in {n.name for n in sinks}
        if sinks:   # a pipeline stage: (loss or None, *values sent to later stages)
            loss = self.env[self.graph.loss] if has_loss else None
            self.out.output((loss, *[self.env[n.name] for n in sinks]))
        else:
            self.out.output(self.env[self.graph.loss])
        root = torch.nn.Module()
        for attr, value in self.constants.items():
            root.register_buffer(attr, value, persistent=False)
        gm = fx.GraphModule(root, self.out)
        partial = self.values[self.graph.loss].layout.partial if has_loss else ()
        return LocalProgram(gm, tuple(phs), self.values, partial,
                            tuple(n.inputs[0] for n in sinks), has_loss, tuple(scales), owner)

    def _sink(self, node: Node) -> None:
        """A value sent to a later stage, in the (never partial) layout the plan sends it in."""
        dec = self.ops[node.name]
        (name,) = node.inputs
        want = _layout(dec.inputs[0], len(self.graph.by_name[name].out.shape))
        self.values[node.name], self.env[node.name] = self._reshard(
            name, want, dec.grad_partial[0], node.name)

    # ---------------------------------------------------------------- sources
    def _source(self, node: Node) -> None:
        if node.role == "constant":
            orig = self.fx_nodes[node.name]
            if orig.op == "get_attr":  # a tensor constant traced into the program
                self.constants[orig.target] = local_ops.materialize_constant(
                    getattr(self.traced.graph_module, orig.target))
                self.env[node.name] = self.out.get_attr(orig.target)
            elif node.op in LIKE_OPS:  # from the global shape, not a local operand's
                self.env[node.name] = self.out.call_function(
                    local_ops.constant_like, (node.op, node.out.shape, node.out.dtype,
                                              local_ops.fill_value(node.op, orig)),
                    {"device": torch.device("cpu")})
            else:
                self.env[node.name] = self.out.call_function(orig.target, orig.args,
                                                             dict(orig.kwargs))
            self.values[node.name] = source_sharded(node.out.shape, Layout.replicated(
                len(node.out.shape)), self.pos)
            return
        self.env[node.name] = self.out.placeholder(node.name)
        if node.role == "param":
            dec = self.params[node.name]
            spec = dec.spec
            if dec.update == "zero3" and node.name in self.unit_of:
                self.to_gather.add(node.name)
        elif node.role == "buffer":
            spec = Layout.replicated(len(node.out.shape)).spec()
        else:
            spec = self.sources[node.name]
        self.values[node.name] = source_sharded(node.out.shape,
                                                _layout(spec, len(node.out.shape)), self.pos,
                                                self._units(node.name, len(node.out.shape)))

    # ---------------------------------------------------------------- ops
    def _op(self, node: Node) -> None:
        dec = self.ops[node.name]
        operands, shardeds = [], []
        for j, name in enumerate(node.inputs):
            want = _layout(dec.inputs[j], len(self.graph.by_name[name].out.shape))
            val, fxn = self._reshard(name, want, dec.grad_partial[j], node.name)
            operands.append(fxn)
            shardeds.append(val)
        if self.half is not None and runs_half(node):
            cast = zero3.cast if self.gathers else local_ops.cast_float
            operands = [self.out.call_function(cast, (o, self.half)) for o in operands]
        out_layout = _layout(dec.output, len(node.out.shape))
        result = op_output(node.sig, shardeds, node.out.shape, out_layout, self.pos,
                           self._units(node.name, len(node.out.shape)))
        self.values[node.name] = result
        if node.op == BUFFER_WRITE:   # whole on every rank, as the plan lays both out
            buffer = self.graph.by_name[node.inputs[0]].state_name
            self.env[node.name] = self.out.call_function(local_ops.write_buffer,
                                                         (buffer, *operands))
            return
        special = self._class_split(node, dec, operands, shardeds)
        if special is not None:
            self.env[node.name] = special
            return
        if node.op == "bernoulli":
            orig = self.fx_nodes[node.name]
            self.env[node.name] = self.out.call_function(
                local_ops.bernoulli_like_one_device,
                (orig.target, operands[0], tuple(orig.args[1:]), dict(orig.kwargs), self.rng,
                 node.name))
            return
        if node.op == "native_dropout":
            self.env[node.name] = local_ops.emit_dropout(self.out, self.fx_nodes[node.name],
                                                         operands[0], self.rng, node.out.shape,
                                                         piece_offsets(result, self.pos),
                                                         node.name)
            return
        use = self.sfb.get(node.name)
        weight = operands[use.weight] if use else None
        if use:   # autograd computes the activation's gradient only; the weight's: below
            operands[use.weight] = self.out.call_method("detach", (weight,))
        out = local_ops.emit(self.out, self.fx_nodes[node.name], node, operands,
                             local_shape(result, self.pos), bool(out_layout.partial), self.comm,
                             tuple(dec.sync_axes), node.name in self.scaled)
        if use:
            a = node.inputs[use.activation]
            out = self.out.call_function(sfb_runtime.weight_grad, (
                self.comm, out, weight, operands[use.activation],
                self._factor_gathers(shardeds[use.activation], a),
                self._factor_gathers(result, node.name), use.equation))
        self.env[node.name] = out

    def _factor_gathers(self, val: Sharded, name: str) -> tuple[sfb_runtime.Gather, ...]:
        """The all-gathers making an SFB factor (a value in layout ``val``) whole, as the plan
        priced them (`planner/intra/sfb.gather_steps`)."""
        out = []
        for step in gather_steps(val.layout, self.graph.by_name[name].out.nbytes,
                                 self.plan.mesh_shape):
            val, sizes = gathered(val, step.dim, step.axes, self.pos)
            out.append((step.dim, tuple(step.axes), tuple(sizes), self._impl(step)))
        return tuple(out)

    def _class_split(self, node: Node, dec: OpDecision, operands: list[fx.Node],
                     shardeds: list[Sharded]) -> fx.Node | None:
        """Vocabulary- or class-split embedding, softmax and NLL: local rules, or None."""
        call, orig = self.out.call_function, self.fx_nodes[node.name]
        if node.op == "embedding" and shardeds[0].layout.dims[0]:
            start = piece_offsets(shardeds[0], self.pos)[0][0]
            padding = orig.args[2] if len(orig.args) > 2 else orig.kwargs.get("padding_idx", -1)
            return call(local_ops.vocab_parallel_embedding, (operands[0], operands[1], start,
                                                             padding))
        if node.op in ("softmax", "log_softmax") and dec.sync_axes:
            return call(local_ops.softmax_split, (self.comm, operands[0], orig.args[1],
                                                  tuple(dec.sync_axes),
                                                  node.op == "log_softmax"))
        if node.op == "nll_loss" and shardeds[0].layout.dims[1]:
            start = piece_offsets(shardeds[0], self.pos)[1][0]
            reduction = orig.args[3] if len(orig.args) > 3 else 1
            ignore = orig.args[4] if len(orig.args) > 4 else -100
            weight = operands[2] if len(operands) > 2 else None
            return call(local_ops.nll_loss_class_split,
                        (self.comm, operands[0], operands[1], weight, start, ignore, reduction,
                         tuple(dec.sync_axes), node.name in self.scaled))
        return None

    def _reshard(self, name: str, want: Layout, grad_partial: tuple[int, ...], consumer: str
                 ) -> tuple[Sharded, fx.Node]:
        """``name`` moved into ``want``, once per distinct recipe: consumers that need the same
        move share it, so its collectives run once (the ILP charges them once, `fanout.py`)."""
        if name in self.to_gather:
            self._gather(name)
        producer = self.graph.by_name[name]
        recipe = reshard(self.values[name].layout, want, producer.out.nbytes,
                         self.plan.mesh_shape, tuple(grad_partial), producer.requires_grad,
                         name in self.param_root)
        # A view of a parameter passes its gradient through: only its other consumers are uses.
        through = consumer in self.param_root
        key = (name, recipe, through)
        if key not in self.moved:
            val, fxn = self.values[name], self.env[name]
            if not through:
                fxn = self._param_use(name, recipe.sync_axes)
            for step in recipe.steps:
                val, fxn = self._step(step, val, fxn, name)
            self.moved[key] = (val, fxn)
        if len(self.positions) == 1:
            return self.moved[key]
        if (*key, self.segment) not in self.moved:
            self.moved[(*key, self.segment)] = self._resplit(name, *self.moved[key])
        return self.moved[(*key, self.segment)]

    def _resplit(self, name: str, val: Sharded, fxn: fx.Node) -> tuple[Sharded, fx.Node]:
        """``val`` with every split dim cut as this node's segment cuts it: a dim another
        segment cut is re-cut by an all-to-all (`C.resplit`)."""
        units = self._units(name, len(val.shape))
        for d, (axes, pieces) in enumerate(zip(val.layout.dims, val.pieces)):
            want = cut(val.shape[d], axes, self.pos.weights, units[d]) if axes else None
            if want is not None and tuple(pieces) != want:
                fxn = self.out.call_function(C.resplit, (self.comm, fxn, axes, d, pieces, want))
                val = Sharded(val.shape, val.layout,
                              tuple(want if e == d else p for e, p in enumerate(val.pieces)))
        return val, fxn

    def _gather(self, name: str) -> None:
        """A ZeRO-3 parameter's unit gathered from its shards, emitted before the first use of
        any of its members, so that each is whole only from there to its last use."""
        u = self.unit_of[name]
        members = self.zero3_units[u].params
        missing = [p for p in members if p not in self.env]
        assert not missing, f"meshplan internal error: unit {u} is used before {missing} exist"
        whole = self.out.call_function(zero3.gather_unit,
                                       (self.comm, u, *[self.env[p] for p in members]))
        for i, p in enumerate(members):
            self.to_gather.discard(p)
            self.env[p] = self.out.call_function(operator.getitem, (whole, i))
            self.gathers.add(self.env[p])

    def _param_use(self, name: str, use_axes: tuple[int, ...]) -> fx.Node:
        """A parameter's use whose gradient is partial over ``use_axes`` while the update phase
        synchronizes over other axes: all-reduced in backward on its own and scaled, as
        `meshplan.planner.intra.fanout.param_sync` prescribes; other values pass through."""
        fxn = self.env[name]
        if name not in self.param_root:
            return fxn
        update = tuple(self.params[self.param_root[name]].sync_axes)
        if tuple(use_axes) == update:
            return fxn
        if use_axes:
            fxn = self.out.call_function(C.grad_all_reduce, (self.comm, fxn, tuple(use_axes)))
        group = self.pos.group(update)
        return self.out.call_function(C.grad_scale, (fxn, 1.0 / group)) if group > 1 else fxn

    def _step(self, s: Step, val: Sharded, x: fx.Node, name: str
              ) -> tuple[Sharded, fx.Node]:
        call, pos, comm = self.out.call_function, self.pos, self.comm
        units = self._units(name, len(val.shape))
        if s.op == "all_reduce":
            remaining = tuple(a for a in val.layout.partial if a not in s.axes)
            return with_partial(val, remaining), call(C.all_reduce, (comm, x, s.axes),
                                                      {"backward": s.backward})
        if s.op == "grad_all_reduce":
            return val, call(C.grad_all_reduce, (comm, x, s.axes))
        if s.op == "reduce_scatter":
            new, sizes = split_more(with_partial(val, ()), s.dim, s.axes, pos, units[s.dim])
            return new, call(C.reduce_scatter, (comm, x, s.axes, s.dim, sizes),
                             {"impl": self._impl(s)})
        if s.op == "all_gather":
            new, sizes = gathered(val, s.dim, s.axes, pos)
            return new, call(C.all_gather, (comm, x, s.axes, s.dim, sizes),
                             {"backward": s.backward, "impl": self._impl(s)})
        if s.op == "split":
            new, sizes = split_more(val, s.dim, s.axes, pos, units[s.dim])
            return new, call(C.split, (comm, x, s.axes, s.dim, sizes), {"backward": s.backward})
        if s.op == "all_to_all":
            mid, concat_sizes = gathered(val, s.dim, s.axes, pos)
            new, split_sizes = split_more(mid, s.dim2, s.axes, pos, units[s.dim2])
            return new, call(C.all_to_all, (comm, x, s.axes, s.dim2, split_sizes, s.dim,
                                            concat_sizes))
        raise AssertionError(f"unknown reshard step {s.op}")


def lower(traced: Traced, graph: Graph, plan: Plan, rank: int,
          weights: tuple[tuple[float, ...], tuple[float, ...]],
          device: torch.device | str = "cpu",
          scaled: tuple[microbatch.BatchReduction, ...] = ()) -> LocalProgram:
    """The local program of ``rank`` (see the module docstring), making whatever it creates
    (constants, masks, factory results) on ``device``; the results of the loss's batch
    reductions ``scaled`` multiplied by per-micro-batch scales it takes as inputs (the data's
    statistics replaced by their whole-batch values)."""
    program = _Lowerer(traced, graph, plan, MeshPos(plan.mesh_shape, rank, weights)).run(
        tuple(scaled))
    place(program.graph_module, torch.device(device))
    return program


def place(gm: fx.GraphModule, device: torch.device) -> None:
    """Move what ``gm`` creates onto ``device``: the program was traced on (fake) CPU tensors,
    so its factory ops name the CPU (``arange(..., device=cpu)``, a copy ``to`` the CPU), its
    tensor constants live there, and its attention is the CPU kernel's (run as the same
    attention by the device's own kernels, `local_ops.attention`)."""
    if device.type == "cpu":
        return
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            node.target = local_ops.attention
        where = node.kwargs.get("device")
        if where is not None and torch.device(where).type == "cpu":
            node.kwargs = {**node.kwargs, "device": device}
    for name, value in list(gm.named_buffers()):
        owner, _, attr = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, attr, value.to(device))
    gm.recompile()


__all__ = ["LocalProgram", "lower"]
