"""Run a multi-stage plan on one rank: its stage's program, the static instruction list of the
plan's schedule, and cross-mesh resharding of what crosses stages.

Each rank belongs to one stage and runs that stage's intra-operator plan with a `Trainer` over
the stage's mesh (its own communicator: collectives stay inside the stage). The rank follows its
instruction list (`lower/pipeline_program.py`) with no coordinator: RECV assembles its tile of a
value from the point-to-point transfers of the value's resharding plan (`lower/cross_mesh.py`)
and the local all-gathers among destination replicas; RUN forward runs the stage program on the
micro-batch and keeps what backward needs; SEND posts its part of each transfer; RUN backward
back-propagates the loss (weighted 1/B, the mean over the global batch) and the gradients that
came back for the values it sent; FREE drops a micro-batch's activations; APPLY_GRAD synchronizes
the stage's gradients over its mesh and steps the optimizer. Gradients accumulate over the
micro-batches in autograd, so the step equals one full-batch step.

A parameter several stages read (GPT's embedding, tied to its LM head) lives in each of them,
in each stage's own layout. After the in-stage synchronization every holder sends its gradient
to the others (cross-mesh resharded into their layouts) and each sums all parts in stage order,
so every copy takes bitwise the same update, as Megatron-LM all-reduces the embedding gradient
between its first and last stage.

The runtime counts the micro-batches whose activations it holds (`PipelineTrainer.peak_held`),
the accounting the schedule's memory bound (1F1B: S - i on stage i) is checked against.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.capture.trace import Traced
from meshplan.ir.graph import Graph
from meshplan.lower.cross_mesh import Box, MeshRanks, ReshardPlan, plan_reshard
from meshplan.lower.instructions import Instruction
from meshplan.lower.pipeline_program import Exchange, pipeline_program, stage_graphs
from meshplan.plan.plan import Plan
from meshplan.planner.intra.layout import Layout
from meshplan.runtime.comm import Comm
from meshplan.runtime.p2p import P2P
from meshplan.runtime.trainer import Trainer

_KINDS = {"activation": 0, "gradient": 1, "gather": 2, "loss": 3, "tied": 4, "norm": 5}


class PipelineTrainer:
    """Trains with a multi-stage ``plan`` on global rank ``p2p.rank``; ``step(batch) -> loss``.

    ``comm`` is the communicator of this rank's stage mesh (ranks numbered inside the stage);
    ``p2p`` the point-to-point endpoint between global ranks. Every rank passes the same model
    state and batches, as with `Trainer`. Raises ValueError if the model's trace is not the
    program the plan was made for, NotImplementedError for a parameter two stages share while
    one keeps it ZeRO-sharded.
    """

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable | None,
                 example_batch: Any, comm: Comm, p2p: P2P, *,
                 captured: tuple[Traced, Graph] | None = None) -> None:
        self.plan, self.p2p, self.rank = plan, p2p, p2p.rank
        self.program = pipeline_program(plan)
        self.stage = self.program.stage_of(self.rank)
        micro = split_microbatches(example_batch, plan.microbatches)[0]
        traced, graph = captured or capture(model, loss_fn, micro)
        if graph.fingerprint() != plan.graph_fingerprint:
            raise ValueError("this model's traced program differs from the one the plan was made "
                             "for (different model, shapes or batch); make a new plan")
        graphs = stage_graphs(graph, plan)
        stage = plan.stages[self.stage]
        self.trainer = Trainer(stage.plan, model, loss_fn, example_batch, comm,
                               captured=(traced, graphs[self.stage]))
        self.graph = graphs[self.stage]
        self.meshes = [MeshRanks(tuple(s.mesh_shape), tuple(s.devices)) for s in plan.stages]
        self._moves: dict[tuple[int, str], ReshardPlan] = {}
        for k, e in enumerate(self.program.exchanges):
            if self.stage in (e.src, e.dst):
                node = graph.by_name[e.value]
                shape, ndim = tuple(node.out.shape), len(node.out.shape)
                src, dst = Layout.parse(e.src_spec, ndim), Layout.parse(e.dst_spec, ndim)
                size = torch.empty((), dtype=_dtype(node.out.dtype)).element_size()
                self._moves[(k, "activation")] = plan_reshard(
                    shape, size, self.meshes[e.src], src, self.meshes[e.dst], dst)
                self._moves[(k, "gradient")] = plan_reshard(
                    shape, size, self.meshes[e.dst], dst, self.meshes[e.src], src)
        self._requires_grad = {e.value: graph.by_name[e.value].requires_grad
                               for e in self.program.exchanges}
        self._tied = self._tied_moves(graph)
        self.held = 0
        self.peak_held = 0

    # ---------------------------------------------------------------- one step
    def step(self, batch: Any, *, seed: int | None = None) -> float:
        """One training step on the global ``batch`` (as `Trainer.step`); returns the loss."""
        t = self.trainer
        rng = t.begin_step(seed)
        micro = split_microbatches(batch, self.plan.microbatches)
        count = len(micro)
        inbox: dict[int, dict[str, torch.Tensor]] = {}
        grads: dict[int, dict[str, torch.Tensor]] = {}
        kept: dict[int, tuple[torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        total: torch.Tensor | None = None
        for ins in self.program.for_rank(self.rank):
            j = ins.microbatch
            if ins.op == "RECV" and ins.kind == "activation":
                for k, e in self._exchanges(ins.peer, ins.stage):
                    value = self._receive(k, e, "activation", j)
                    inbox.setdefault(j, {})[e.value] = value.requires_grad_(self._grad(e))
            elif ins.op == "RUN" and ins.kind == "forward":
                out = t._run(t._program_args(t.local_batch(micro[j]), inbox.get(j, {})), rng)
                loss, values = t.program.split_output(out)
                kept[j] = (loss, dict(zip(t.program.sent, values)))
                if loss is not None:
                    total = loss.detach() if total is None else total + loss.detach()
                self.held += 1
                self.peak_held = max(self.peak_held, self.held)
            elif ins.op == "SEND" and ins.kind == "activation":
                for k, e in self._exchanges(ins.stage, ins.peer):
                    self._send(k, e, "activation", j, kept[j][1][e.value])
            elif ins.op == "RECV" and ins.kind == "gradient":
                for k, e in self._exchanges(ins.stage, ins.peer, grad=True):
                    g = self._receive(k, e, "gradient", j)
                    box = grads.setdefault(j, {})
                    box[e.value] = g if e.value not in box else box[e.value] + g
            elif ins.op == "RUN" and ins.kind == "backward":
                loss, sent = kept[j]
                outs = [loss / count] if loss is not None else []
                seeds: list[torch.Tensor | None] = [None] * len(outs)
                for name, value in sent.items():
                    if name in grads.get(j, {}):
                        outs.append(value)
                        seeds.append(grads[j][name])
                if outs:
                    torch.autograd.backward(outs, seeds)
                    t.own_gradients()
            elif ins.op == "SEND" and ins.kind == "gradient":
                for k, e in self._exchanges(ins.peer, ins.stage, grad=True):
                    received = inbox[j][e.value]
                    g = received.grad if received.grad is not None else \
                        torch.zeros_like(received)
                    self._send(k, e, "gradient", j, g)
            elif ins.op == "FREE":
                kept.pop(j), inbox.pop(j, None), grads.pop(j, None)
                self.held -= 1
            elif ins.op == "APPLY_GRAD":
                elsewhere = frozenset(name for name, stages, _ in self._tied
                                      if stages[0] != self.stage)
                t.apply_gradients(self._sum_tied, self._sum_over_stages, elsewhere)
        self.p2p.wait_all()
        return self._report(total, count)

    def _exchanges(self, src: int, dst: int, grad: bool = False
                   ) -> list[tuple[int, Exchange]]:
        """The values stage ``src`` sends ``dst`` (with ``grad``: those whose gradient comes
        back, i.e. that require one)."""
        return [(k, e) for k, e in enumerate(self.program.exchanges)
                if e.src == src and e.dst == dst and (not grad or self._grad(e))]

    def _grad(self, e: Exchange) -> bool:
        return self._requires_grad[e.value]

    # ---------------------------------------------------------------- resharding
    def _send(self, k: int, e: Exchange, kind: str, j: int, local: torch.Tensor) -> None:
        """This rank's part of exchange ``k``'s move of ``kind`` for micro-batch ``j``."""
        move = self._moves[(k, kind)]
        mine = self._my_tile(e, kind)
        for n, tr in enumerate(move.transfers):
            if tr.src == self.rank:
                assert tr.dst != self.rank, "stages hold disjoint ranks"
                self.p2p.send(local[_local_slices(tr.box, mine)], tr.dst, _tag(kind, j, k, n))

    def _receive(self, k: int, e: Exchange, kind: str, j: int) -> torch.Tensor:
        """This rank's tile of exchange ``k``'s value (or gradient) for micro-batch ``j``."""
        move = self._moves[(k, kind)]
        box = move.dst_tiles[self.rank]
        out: torch.Tensor | None = None
        for n, tr in enumerate(move.transfers):
            if tr.dst != self.rank:
                continue
            shape = tuple(b - a for a, b in tr.box)
            piece = self.p2p.recv(shape, tr.src, _tag(kind, j, k, n))
            if out is None:
                out = torch.zeros(tuple(b - a for a, b in box), dtype=piece.dtype)
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
        box = self._moves[(k, kind)].dst_tiles[self.rank]
        lo = box[g.dim][0]

        def along(q: int) -> tuple[slice, ...]:
            idx = [slice(None)] * out.dim()
            idx[g.dim] = slice(g.cuts[q] - lo, g.cuts[q + 1] - lo)
            return tuple(idx)

        mine = out[along(me)]
        for q, r in enumerate(g.ranks):
            if r != self.rank:
                self.p2p.send(mine, r, _tag("gather", j, k, me * 4 + _KINDS[kind]))
        for q, r in enumerate(g.ranks):
            if r != self.rank:
                shape = tuple(out[along(q)].shape)
                out[along(q)] = self.p2p.recv(shape, r, _tag("gather", j, k, q * 4 + _KINDS[kind]))
        return out

    def _my_tile(self, e: Exchange, kind: str) -> Box:
        """The box of the value this rank holds as a sender of ``kind``."""
        k = self.program.exchanges.index(e)
        other = self._moves[(k, "gradient" if kind == "activation" else "activation")]
        return other.dst_tiles[self.rank]

    # ---------------------------------------------------------------- tied parameters
    def _tied_moves(self, graph: Graph) -> list[tuple[str, list[int], dict[int, tuple]]]:
        """Per parameter my stage shares with others (by name, in name order): its holder
        stages and, per other holder, the moves of the gradient there and back. Raises
        NotImplementedError when a holder keeps it sharded by ZeRO (its gradient is then a
        shard of the data-parallel group, not the whole in the stage's layout)."""
        holders: dict[str, list[tuple[int, Any]]] = {}
        for s in self.plan.stages:
            for p in s.plan.params if s.plan else ():
                holders.setdefault(p.name, []).append((s.index, p))
        out = []
        for name in sorted(holders):
            stages = holders[name]
            if len(stages) < 2 or self.stage not in [i for i, _ in stages]:
                continue
            for i, p in stages:
                if p.update != "replicated":
                    raise NotImplementedError(
                        f"parameter {name!r} is shared by stages {[i for i, _ in stages]} and "
                        f"stage {i} keeps it {p.update}; summing a ZeRO-sharded gradient across "
                        "stages is not implemented: plan without ZeRO for it")
            mine = dict(stages)[self.stage]
            node = graph.by_name[mine.node]
            shape, ndim = tuple(node.out.shape), len(node.out.shape)
            size = torch.empty((), dtype=_dtype(node.out.dtype)).element_size()
            moves = {}
            for i, p in stages:
                if i != self.stage:
                    a, b = Layout.parse(mine.spec, ndim), Layout.parse(p.spec, ndim)
                    moves[i] = (plan_reshard(shape, size, self.meshes[self.stage], a,
                                             self.meshes[i], b, local_gather=False),
                                plan_reshard(shape, size, self.meshes[i], b,
                                             self.meshes[self.stage], a, local_gather=False))
            out.append((name, [i for i, _ in stages], moves))
        return out

    def _sum_tied(self) -> None:
        """Each shared parameter's gradient: the sum of every holder's part, in stage order."""
        by_name = {p.name: p for p in self.trainer.params}
        for k, (name, stages, moves) in enumerate(self._tied):
            p = by_name[name]
            grad = p.compute.grad
            mine_box = next(iter(moves.values()))[1].dst_tiles[self.rank]
            for i, (there, _) in moves.items():
                for n, tr in enumerate(there.transfers):
                    if tr.src == self.rank:
                        self.p2p.send(grad[_local_slices(tr.box, mine_box)], tr.dst,
                                      _tag("tied", k, self.stage, n))
            parts = {}
            for i, (_, back) in moves.items():
                part = torch.zeros_like(grad)
                for n, tr in enumerate(back.transfers):
                    if tr.dst == self.rank:
                        shape = tuple(b - a for a, b in tr.box)
                        part[_local_slices(tr.box, mine_box)] = self.p2p.recv(
                            shape, tr.src, _tag("tied", k, i, n))
                parts[i] = part
            parts[self.stage] = grad
            total = parts[stages[0]].clone()
            for i in stages[1:]:
                total += parts[i]
            p.compute.grad = total

    def _sum_over_stages(self, mine: torch.Tensor) -> torch.Tensor:
        """The sum over stages of a value every rank of a stage holds alike (the squared
        gradient norm for clipping), the same on every rank: each stage's first rank sends its
        value to the other stages' ranks, and each rank adds the values in stage order."""
        tag = _tag("norm", 0, 0, 0)
        if self.rank == self.meshes[self.stage].ranks[0]:
            for s, mesh in enumerate(self.meshes):
                if s != self.stage:
                    for r in mesh.ranks:
                        self.p2p.send(mine.reshape(1), r, tag)
        parts = [mine.reshape(1) if s == self.stage else
                 self.p2p.recv((1,), mesh.ranks[0], tag) for s, mesh in enumerate(self.meshes)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total[0]

    # ---------------------------------------------------------------- the loss
    def _report(self, total: torch.Tensor | None, count: int) -> float:
        """The step's loss on every rank: the last stage reduces it over its mesh, its first
        rank sends it to every rank of the other stages."""
        last = len(self.meshes) - 1
        tag = _tag("loss", 0, 0, 0)
        if self.stage == last:
            assert total is not None
            loss = self.trainer._report(total / count)
            if self.rank == self.meshes[last].ranks[0]:
                for s in range(last):
                    for r in self.meshes[s].ranks:
                        self.p2p.send(torch.tensor([loss], dtype=torch.float64), r, tag)
                self.p2p.wait_all()
            return loss
        got = self.p2p.recv((1,), self.meshes[last].ranks[0], tag)
        return float(got[0])

    # ---------------------------------------------------------------- inspection
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters gathered whole (each stage holds its own)."""
        return self.trainer.full_state_dict()




def _local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _tag(kind: str, microbatch: int, exchange: int, piece: int) -> int:
    """A message tag unique per (kind, micro-batch, exchange, piece) within one step, below
    2^31 (a transport's tag may be a 32-bit int)."""
    if not (microbatch < 1024 and exchange < 64 and piece < 4096):
        raise NotImplementedError(f"the pipeline runtime tags at most 1024 micro-batches, 64 "
                                  f"values crossing stages and 4096 transfers per value; got "
                                  f"micro-batch {microbatch}, value {exchange}, transfer {piece}")
    return ((_KINDS[kind] * 1024 + microbatch) * 64 + exchange) * 4096 + piece


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
