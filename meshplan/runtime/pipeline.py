"""Run a multi-stage plan on one rank: its stage's program, the static instruction list of the
plan's schedule, and cross-mesh resharding of what crosses stages.

Each rank belongs to one stage mesh and runs the intra-operator plan of each stage on that mesh
(one under GPipe and 1F1B; ``chunks`` virtual stages under interleaved 1F1B) with a `Trainer`
per stage over the mesh's communicator (collectives stay inside the mesh). The rank follows its
instruction list (`lower/pipeline_program.py`) with no coordinator: RECV assembles its tile of a
value from the point-to-point transfers of the value's resharding plan (`lower/cross_mesh.py`)
and the local all-gathers among destination replicas; RUN forward runs the stage program on the
micro-batch and keeps what backward needs; SEND posts its part of each transfer; RUN backward
back-propagates the loss (weighted 1/B, the mean over the global batch) and the gradients that
came back for the values it sent; FREE drops a micro-batch's activations; APPLY_GRAD synchronizes
each stage's gradients over its mesh and steps its optimizer (all of a rank's stages together,
so clipping sees every stage's norm). Gradients accumulate over the
micro-batches in autograd, so the step equals one full-batch step.

A parameter several stages read (GPT's embedding, tied to its LM head) lives in each of them,
in each stage's own layout. After the in-stage synchronization every holder sends its gradient
to the others (cross-mesh resharded into their layouts) and each sums all parts in stage order,
so every copy takes bitwise the same update, as Megatron-LM all-reduces the embedding gradient
between its first and last stage.

The runtime counts the micro-batches whose activations it holds (`PipelineTrainer.peak_held`;
under interleaving one per micro-batch and chunk), the accounting the schedule's memory bound
(1F1B: S - i on stage i) is checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from meshplan.capture.batch import batch_shapes, split_microbatches
from meshplan.capture.trace import Traced
from meshplan.ir.graph import Graph
from meshplan.lower.cross_mesh import Box
from meshplan.lower.microbatch import StepScales
from meshplan.lower.pipeline_program import (Exchange, pipeline_program, recompute_layers,
                                             stage_graphs)
from meshplan.lower.stage_transfers import stage_moves
from meshplan.plan.plan import Plan
from meshplan.runtime.comm import Comm, ProcessGroupComm
from meshplan.runtime.dropout import DropoutStream, stream_for
from meshplan.runtime.failure import StepGuard
from meshplan.runtime.grad_norm import clip_engines
from meshplan.runtime.p2p import P2P, ProcessGroupP2P
from meshplan.runtime.trainer import Trainer, check_rows, locked_capture, shape_key

_KINDS = {"activation": 0, "gradient": 1, "gather": 2, "loss": 3, "tied": 4, "norm": 5,
          "state": 6}


class PipelineTrainer:
    """Trains with a multi-stage ``plan`` on global rank ``p2p.rank``; ``step(batch) -> loss``.

    ``comm`` is the communicator of this rank's stage mesh (ranks numbered inside the mesh);
    ``p2p`` the point-to-point endpoint between global ranks. Every rank passes the same model
    state and batches, as with `Trainer`. ``mesh`` is this rank's mesh, ``stages`` the
    (virtual) stages it runs. Raises ValueError if the model's trace is not the program the
    plan was made for, NotImplementedError for a parameter two stages share while one keeps it
    ZeRO-sharded. ``local_gather`` False sends each destination replica its whole tile
    instead of Alpa's local all-gather (the plan's transfers assume it; for comparison).
    """

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable | None,
                 example_batch: Any, comm: Comm, p2p: P2P, *,
                 captured: tuple[Traced, Graph] | None = None,
                 local_gather: bool = True, local_batches: bool = False) -> None:
        if plan.num_stages < 2:
            raise ValueError(f"plan {plan.model!r} has one stage: train it with "
                             "meshplan.runtime.trainer.Trainer, not PipelineTrainer")
        if comm.device != p2p.device:
            raise ValueError(f"the stage's communicator computes on {comm.device} but the "
                             f"point-to-point endpoint receives on {p2p.device}")
        self.plan, self.p2p, self.rank = plan, p2p, p2p.rank
        self.program = pipeline_program(plan)
        self.mesh = self.program.mesh_of(self.rank)
        self.stages = self.program.stages_on(self.mesh)
        micro = split_microbatches(example_batch, plan.microbatches)[0]
        traced, graph = captured or locked_capture(model, loss_fn, micro)
        if graph.fingerprint() != plan.graph_fingerprint:
            raise ValueError("this model's traced program differs from the one the plan was made "
                             "for (different model, shapes or batch); make a new plan")
        graphs = stage_graphs(graph, plan)
        # Each stage's parameters and buffers, whole shapes, by name (`whole_state`).
        self._stage_state = [{n.state_name: n.out.shape for n in g.nodes
                              if n.role in ("param", "buffer") and n.state_name}
                             for g in graphs]
        self.planned_shapes = batch_shapes(example_batch)
        # The loss's batch reductions, of the whole program (`lower/microbatch.py`).
        self._scales = StepScales(traced.graph_module, graph,
                                  lambda: locked_capture(model, loss_fn, example_batch)[1]) \
            if plan.microbatches > 1 else None
        layers = recompute_layers(graph, plan) if any(
            plan.stages[s].recompute for s in self.stages) else None
        self.trainers = {s: Trainer(plan.stages[s].plan, model, loss_fn, example_batch, comm,
                                    captured=(traced, graphs[s]), scales=self._scales,
                                    layers=layers, other_shapes=False,
                                    local_batches=local_batches, pipeline=(plan, p2p.rank),
                                    dropout=False)
                         for s in self.stages}
        self._local = local_batches
        self._moves = stage_moves(plan, self.program.exchanges, graph, local_gather)
        # Other batch shapes (`serve`): each shape's moves and scales, its stage programs.
        self._model, self._loss_fn, self._gather_locally = model, loss_fn, local_gather
        # The stages' dropouts draw the whole program's masks for the whole batch, as one
        # device does (`runtime/dropout.py`).
        self._dropout = self._stream(traced, graph, example_batch)
        self._shape = shape_key(example_batch)
        self._variants = {self._shape: (self._scales, self._moves, self._dropout)}
        self._tied = [(k, name, me, {i: (self._moves.tied[(name, me, i)],
                                         self._moves.tied[(name, i, me)])
                                     for i in stages if i != me})
                      for k, (name, stages) in enumerate(self._moves.shared.items())
                      for me in stages if me in self.stages]
        self._shared = self._moves.shared
        self._tag = _Tags.fitting(max(plan.microbatches, len(self._shared)),
                                  max(len(self.program.exchanges), plan.num_stages))
        self.held = 0
        self.peak_held = 0
        self._synced = False   # `synchronize_gradients`
        # A step failing on one rank fails alike on every rank (`runtime/failure.py`).
        active = isinstance(comm, ProcessGroupComm) and isinstance(p2p, ProcessGroupP2P)
        self.guard = StepGuard([comm.rebuild, p2p.rebuild] if active else [], self.undo_step,
                               active=active)

    def _stream(self, traced: Traced, graph: Graph, batch: Any) -> DropoutStream | None:
        """The whole program's dropouts as one device draws them for the global ``batch``
        (`runtime/dropout.py`), or None when it has none."""
        return stream_for(traced.graph_module, graph, self.plan.dtype, self.plan.microbatches,
                          batch, lambda b: locked_capture(self._model, self._loss_fn, b))

    def undo_step(self) -> None:
        """What a failed step left, dropped on each stage this rank runs (`Trainer.undo_step`)."""
        for t in self.trainers.values():
            t.undo_step()
        self._synced = False
        self.held = 0

    def serve(self, batch: Any) -> None:
        """Run the next steps on ``batch``'s shape, as `Trainer.serve`: the model traced at
        that shape, cut into the stages, each stage's plan lowered on its program, the moves
        between stages sized anew; once per shape, on every rank alike."""
        if self._local:   # this rank's rows and tensors, of the planned shape
            for t in self.trainers.values():
                t.serve(batch)
            return
        key = shape_key(batch)
        if key == self._shape:
            return
        for t in self.trainers.values():
            t.check_form(batch)
        if key not in self._variants:
            plan = self.plan
            micro = split_microbatches(batch, plan.microbatches)[0]
            check_rows(micro, self.planned_shapes, plan.microbatches)
            traced, graph = locked_capture(self._model, self._loss_fn, micro)
            graphs = stage_graphs(graph, plan, check=False)
            scales = StepScales(traced.graph_module, graph,
                                lambda: locked_capture(self._model, self._loss_fn, batch)[1]) \
                if plan.microbatches > 1 else None
            for s, t in self.trainers.items():
                t.adopt(key, traced, graphs[s], scales)
            self._variants[key] = (scales, stage_moves(plan, self.program.exchanges, graph,
                                                       self._gather_locally),
                                   self._stream(traced, graph, batch))
        for t in self.trainers.values():
            t.use(key)
        self._scales, self._moves, self._dropout = self._variants[key]
        self._shape = key

    # ---------------------------------------------------------------- one step
    def step(self, batch: Any, *, seed: int | None = None, apply: bool = True) -> float:
        """One training step on the global ``batch`` (as `Trainer.step`); returns the loss.
        ``apply`` False leaves APPLY_GRAD to the caller (`prepare_gradients`, then the
        optimizer of every stage, then `after_update`: `meshplan.parallelize`)."""
        self.serve(batch)
        self.guard.begin(next(iter(self.trainers.values()))._steps)
        with self.guard.running():
            return self._step(batch, seed, apply)

    def _step(self, batch: Any, seed: int | None, apply: bool) -> float:
        rngs = {s: t.begin_step(seed) for s, t in self.trainers.items()}
        if self._dropout is not None:   # one stream for every stage, from the same seed
            stream = self._dropout.begin(next(iter(rngs.values())))
            rngs = {s: stream for s in rngs}
        first = next(iter(self.trainers.values()))
        micro = first.split(batch)   # (every stage of a rank reads the same rows)
        count = len(micro)
        if self._local:   # each stage counts its own reductions' scales
            per_stage = {s: t.step_scales(micro) for s, t in self.trainers.items()}
            scales = [{k: v for s in per_stage for k, v in (per_stage[s][j] or {}).items()}
                      for j in range(count)]
        else:
            scales = self._scales(micro) \
                if any(t.program.scaled for t in self.trainers.values()) else [None] * count
        # Keyed by (stage, micro-batch): a rank may run several stages.
        inbox: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        kept: dict[tuple[int, int], tuple[torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        total: torch.Tensor | None = None
        # Under torch.no_grad() (an evaluation) the forwards only, in the schedule's order:
        # every rank drops the same instructions, so the messages left still pair up.
        backward = torch.is_grad_enabled()
        for ins in self.program.for_rank(self.rank):
            if not backward and (ins.kind == "gradient" or ins.op == "APPLY_GRAD"
                                 or (ins.op == "RUN" and ins.kind == "backward")):
                continue
            j, key = ins.microbatch, (ins.stage, ins.microbatch)
            t = self.trainers[ins.stage]
            if ins.op == "RECV" and ins.kind == "activation":
                for k, e in self._exchanges(ins.peer, ins.stage):
                    value = self._receive(k, e, "activation", j)
                    inbox.setdefault(key, {})[e.value] = value.requires_grad_(self._grad(e))
            elif ins.op == "RUN" and ins.kind == "forward":
                if self._dropout is not None:
                    self._dropout.set_state(j)
                out = t._run(t._program_args(t.local_batch(micro[j]), inbox.get(key, {}),
                                             scales[j]), rngs[ins.stage])
                loss, values = t.program.split_output(out)
                kept[key] = (loss, dict(zip(t.program.sent, values)))
                if loss is not None:
                    total = loss.detach() if total is None else total + loss.detach()
                self.held += 1
                self.peak_held = max(self.peak_held, self.held)
            elif ins.op == "SEND" and ins.kind == "activation":
                for k, e in self._exchanges(ins.stage, ins.peer):
                    self._send(k, e, "activation", j, kept[key][1][e.value])
            elif ins.op == "RECV" and ins.kind == "gradient":
                for k, e in self._exchanges(ins.stage, ins.peer, grad=True):
                    g = self._receive(k, e, "gradient", j)
                    box = grads.setdefault(key, {})
                    box[e.value] = g if e.value not in box else box[e.value] + g
            elif ins.op == "RUN" and ins.kind == "backward":
                loss, sent = kept[key]
                # At the loop's scale of the last step (`Trainer.eager_scale`).
                outs = [loss / count * t.eager_scale()] if loss is not None else []
                seeds: list[torch.Tensor | None] = [None] * len(outs)
                for name, value in sent.items():
                    if name in grads.get(key, {}):
                        outs.append(value)
                        seeds.append(grads[key][name])
                if outs:
                    if j == count - 1:
                        t.last_backward()
                    torch.autograd.backward(outs, seeds)
                    t.own_gradients()
            elif ins.op == "SEND" and ins.kind == "gradient":
                for k, e in self._exchanges(ins.peer, ins.stage, grad=True):
                    received = inbox[key][e.value]
                    g = received.grad if received.grad is not None else \
                        torch.zeros_like(received)
                    self._send(k, e, "gradient", j, g)
            elif ins.op == "FREE":
                kept.pop(key), inbox.pop(key, None), grads.pop(key, None)
                self.held -= 1
            elif ins.op == "APPLY_GRAD" and ins.stage == self.stages[-1] and apply:
                self._apply_gradients()   # every stage of this rank at once
        self.p2p.wait_all()
        return self._report(total, count)

    def _apply_gradients(self) -> None:
        """Every stage of this rank: gradients synchronized over the mesh, shared parameters'
        parts summed across stages, clipped by the global norm over every stage, applied."""
        self.prepare_gradients()
        self.guard.updating = True
        for t in self.trainers.values():
            t.update()
        self.settled()

    def synchronize_gradients(self) -> None:
        """Every stage of this rank: gradients synchronized over the mesh and shared
        parameters' parts summed across stages, once per step (a clip before the optimizer's
        step does it first)."""
        if self._synced:
            return
        for t in self.trainers.values():
            t.synchronize_gradients()
        self._sum_tied()
        self._synced = True

    def scale_loss(self, grad: torch.Tensor) -> None:
        """The caller's ``loss.backward()`` gradient, for every stage of this rank
        (`Trainer.scale_loss`: the whole schedule ran inside the call, unscaled)."""
        for t in self.trainers.values():
            t.scale_loss(grad)

    def settled(self) -> None:
        """The step's gradients were applied or dropped (`Trainer.settled`)."""
        self._synced = False
        for t in self.trainers.values():
            t.settled()

    def prepare_gradients(self) -> None:
        """Every stage of this rank: gradients synchronized over the mesh, shared parameters'
        parts summed across stages, clipped by the global norm over every stage."""
        self.synchronize_gradients()
        if next(iter(self.trainers.values())).spec.max_grad_norm is not None:
            total = self.norm_total(2.0)
            for t in self.trainers.values():
                t.clip(total)
        # Gloo moves an isend's data only once its peer posts the receive: a rank whose last
        # step ends before then (`optimizer.step()` of `parallelize` has no schedule's wait
        # after it) would exit with its part of the tied gradients never sent.
        self.p2p.wait_all()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """The step's gradients synchronized, clipped to ``max_norm`` by their global norm
        over every stage, as one device clips (`runtime/grad_norm.py`); returns that norm."""
        self.synchronize_gradients()
        return clip_engines(self.norm_total(norm_type), norm_type, max_norm,
                            error_if_nonfinite, self.trainers.values())

    def norm_total(self, norm_type: float) -> torch.Tensor:
        """`Trainer.norm_part` over every stage of the pipeline, the same on every rank (a
        parameter several stages share counted by its first)."""
        largest = math.isinf(norm_type)
        mine: torch.Tensor | None = None
        for s, t in self.trainers.items():
            elsewhere = frozenset(name for name, stages in self._shared.items()
                                  if s in stages and stages[0] != s)
            part = t.norm_part(norm_type, elsewhere)
            mine = part.clone() if mine is None else \
                torch.maximum(mine, part) if largest else mine + part
        assert mine is not None
        return self._over_meshes(mine, largest)

    def _exchanges(self, src: int, dst: int, grad: bool = False
                   ) -> list[tuple[int, Exchange]]:
        """The values stage ``src`` sends ``dst`` (with ``grad``: those whose gradient comes
        back, i.e. that require one)."""
        return [(k, e) for k, e in enumerate(self.program.exchanges)
                if e.src == src and e.dst == dst and (not grad or self._grad(e))]

    def _grad(self, e: Exchange) -> bool:
        return self._moves.requires_grad[e.value]

    # ---------------------------------------------------------------- resharding
    def _send(self, k: int, e: Exchange, kind: str, j: int, local: torch.Tensor) -> None:
        """This rank's part of exchange ``k``'s move of ``kind`` for micro-batch ``j``."""
        move = self._moves.exchanges[(k, kind)]
        mine = self._my_tile(e, kind)
        for n, tr in enumerate(move.transfers):
            if tr.src == self.rank:
                self.p2p.send(local[_local_slices(tr.box, mine)], tr.dst,
                              self._tag(kind, j, k, n),
                              kind)

    def _receive(self, k: int, e: Exchange, kind: str, j: int) -> torch.Tensor:
        """This rank's tile of exchange ``k``'s value (or gradient) for micro-batch ``j``."""
        move = self._moves.exchanges[(k, kind)]
        box = move.dst_tiles[self.rank]
        out: torch.Tensor | None = None
        for n, tr in enumerate(move.transfers):
            if tr.dst != self.rank:
                continue
            shape = tuple(b - a for a, b in tr.box)
            piece = self.p2p.recv(shape, tr.src, self._tag(kind, j, k, n))
            if out is None:
                out = torch.zeros(tuple(b - a for a, b in box), dtype=piece.dtype,
                                  device=piece.device)
            where = _local_slices(tr.box, box)
            out[where] = out[where] + piece if tr.summed else piece
        for g in move.gathers:
            if self.rank in g.ranks:
                out = self._local_gather(g, out, kind, j, k)
        assert out is not None, f"rank {self.rank} receives nothing of {e.value}"
        return out

    def _local_gather(self, g, out: torch.Tensor, kind: str, j: int, k: int) -> torch.Tensor:
        """The replicas of a destination tile swap the slices they received (Alpa's local
        all-gather, inside the destination mesh)."""
        me = g.ranks.index(self.rank)
        box = self._moves.exchanges[(k, kind)].dst_tiles[self.rank]
        lo = box[g.dim][0]

        def along(q: int) -> tuple[slice, ...]:
            idx = [slice(None)] * out.dim()
            idx[g.dim] = slice(g.cuts[q] - lo, g.cuts[q + 1] - lo)
            return tuple(idx)

        mine = out[along(me)]
        for q, r in enumerate(g.ranks):
            if r != self.rank:
                self.p2p.send(mine, r, self._tag("gather", j, k, me * 4 + _KINDS[kind]),
                              "gather")
        for q, r in enumerate(g.ranks):
            if r != self.rank:
                shape = tuple(out[along(q)].shape)
                out[along(q)] = self.p2p.recv(shape, r,
                                              self._tag("gather", j, k, q * 4 + _KINDS[kind]))
        return out

    def _my_tile(self, e: Exchange, kind: str) -> Box:
        """The box of the value this rank holds as a sender of ``kind``."""
        k = self.program.exchanges.index(e)
        other = self._moves.exchanges[(k, "gradient" if kind == "activation" else "activation")]
        return other.dst_tiles[self.rank]

    # ---------------------------------------------------------------- tied parameters
    def _sum_tied(self) -> None:
        """Each shared parameter's gradient: the sum of every holder's part, in stage order.
        Every part is posted before any is received (a rank's own stages exchange through
        its local box)."""
        def param(stage: int, name: str):
            return next(p for p in self.trainers[stage].params if p.name == name)

        for k, name, me, moves in self._tied:
            grad = param(me, name).compute.grad
            mine_box = next(iter(moves.values()))[1].dst_tiles[self.rank]
            for there, _ in moves.values():
                for n, tr in enumerate(there.transfers):
                    if tr.src == self.rank:
                        self.p2p.send(grad[_local_slices(tr.box, mine_box)], tr.dst,
                                      self._tag("tied", k, me, n), "tied")
        totals = []
        for k, name, me, moves in self._tied:
            grad = param(me, name).compute.grad
            mine_box = next(iter(moves.values()))[1].dst_tiles[self.rank]
            parts = {me: grad}
            for i, (_, back) in moves.items():
                part = torch.zeros_like(grad)
                for n, tr in enumerate(back.transfers):
                    if tr.dst == self.rank:
                        shape = tuple(b - a for a, b in tr.box)
                        part[_local_slices(tr.box, mine_box)] = self.p2p.recv(
                            shape, tr.src, self._tag("tied", k, i, n))
                parts[i] = part
            order = self._shared[name]
            total = parts[order[0]].clone()
            for i in order[1:]:
                total += parts[i]
            totals.append((param(me, name), total))
        for p, total in totals:
            p.compute.grad = total

    def _ranks_beside(self, mesh: int) -> list[int]:
        """Every rank of the meshes other than ``mesh``, in mesh order."""
        return [r for m, ranks in enumerate(self.program.meshes) if m != mesh for r in ranks]

    def _over_meshes(self, mine: torch.Tensor, largest: bool = False) -> torch.Tensor:
        """The sum (``largest``: the maximum) over meshes of a value every rank of a mesh holds
        alike (a part of the gradient norm), the same on every rank: each mesh's first rank
        sends its value to the other meshes' ranks, and each rank combines the values in mesh
        order."""
        tag = self._tag("norm", 0, 0, 0)
        meshes = self.program.meshes
        if self.rank == meshes[self.mesh][0]:
            for r in self._ranks_beside(self.mesh):
                self.p2p.send(mine.reshape(1), r, tag, "norm")
        parts = [mine.reshape(1) if s == self.mesh else
                 self.p2p.recv((1,), ranks[0], tag) for s, ranks in enumerate(meshes)]
        total = parts[0].clone()
        for part in parts[1:]:
            total = torch.maximum(total, part) if largest else total + part
        return total[0]

    # ---------------------------------------------------------------- the loss
    def _report(self, total: torch.Tensor | None, count: int) -> float:
        """The step's loss on every rank: the last stage reduces it over its mesh, its first
        rank sends it to every rank of the other meshes."""
        last = self.plan.num_stages - 1
        home = self.program.schedule.mesh_of(last)
        meshes = self.program.meshes
        tag = self._tag("loss", 0, 0, 0)
        if self.mesh == home:
            assert total is not None
            loss = self.trainers[last]._report(total / count)
            if self.rank == meshes[home][0]:
                for s, ranks in enumerate(meshes):
                    if s != home:
                        for r in ranks:
                            self.p2p.send(torch.tensor([loss], dtype=torch.float64,
                                                   device=self.p2p.device), r, tag,
                                          "loss")
                self.p2p.wait_all()
            return loss
        got = self.p2p.recv((1,), meshes[home][0], tag)
        return float(got[0])

    # ---------------------------------------------------------------- inspection
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers of this rank's stages, whole (each stage holds its own)."""
        out: dict[str, torch.Tensor] = {}
        for t in self.trainers.values():
            out.update(t.full_state_dict())
        return out

    def whole_state(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters and buffers, whole, on every rank (collective over the
        pipeline's ranks): each is sent by the first rank of the first mesh holding it to every
        rank of the other meshes, in name order."""
        mine = self.full_state_dict()
        meshes = self.program.meshes
        owner: dict[str, int] = {}
        for m in range(len(meshes)):
            for s in self.program.stages_on(m):
                for name in self._stage_state[s]:
                    owner.setdefault(name, m)
        shapes = {name: shape for held in self._stage_state for name, shape in held.items()}
        out = dict(mine)
        for m, ranks in enumerate(meshes):
            names = sorted(n for n, o in owner.items() if o == m)
            if self.rank == ranks[0]:
                for k, name in enumerate(names):
                    for r in self._ranks_beside(m):
                        self.p2p.send(mine[name], r, self._tag.counting("state", k), "state")
            elif self.rank not in ranks:
                for k, name in enumerate(names):
                    got = self.p2p.recv(tuple(shapes[name]), ranks[0],
                                        self._tag.counting("state", k))
                    out.setdefault(name, got)
        self.p2p.wait_all()
        return out




def _local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


# A tag is below 2^31 (a transport's may be a 32-bit int): the kind in its top 3 bits, then
# the fields of the message within its kind.
_FIELD_BITS = 28


@dataclass(frozen=True)
class _Tags:
    """Message tags unique per (kind, micro-batch, exchange, piece) within one step: the
    micro-batch field (or a tied parameter's index) ``first`` bits wide, the exchange (or a
    stage) ``second`` bits, as wide as the pipeline needs, the piece (a transfer of a value)
    the rest. Every rank derives the same widths from the plan."""

    first: int
    second: int

    @staticmethod
    def fitting(firsts: int, seconds: int) -> "_Tags":
        """The widths holding ``firsts`` and ``seconds`` distinct values."""
        return _Tags(max(firsts - 1, 1).bit_length(), max(seconds - 1, 1).bit_length())

    def __call__(self, kind: str, microbatch: int, exchange: int, piece: int) -> int:
        rest = _FIELD_BITS - self.first - self.second
        if not (microbatch < 1 << self.first and exchange < 1 << self.second
                and piece < 1 << max(rest, 0)):
            raise NotImplementedError(
                f"the pipeline runtime's message tags hold {1 << self.first} micro-batches, "
                f"{1 << self.second} values crossing stages and {1 << max(rest, 0)} transfers "
                f"per value here; got micro-batch {microbatch}, value {exchange}, transfer "
                f"{piece}: plan fewer micro-batches")
        return (((_KINDS[kind] << self.first | microbatch) << self.second | exchange) << rest
                | piece)

    def counting(self, kind: str, k: int) -> int:
        """The tag of the ``k``-th message of a kind that has no step fields (`whole_state`)."""
        if k >= 1 << _FIELD_BITS:
            raise NotImplementedError(f"the pipeline runtime tags at most 2^{_FIELD_BITS} "
                                      f"messages of a kind; got message {k}")
        return _KINDS[kind] << _FIELD_BITS | k
