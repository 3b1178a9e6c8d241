"""Run a plan on one rank: local parameter shards, the local program, gradient sync, the update.

One `Trainer` per rank. It traces the model (cheap: fake tensors), checks the trace is the
program the plan was made for, lowers the plan to this rank's local program, and keeps only the
rank's shards of every parameter, on the rank's device (``comm.device``). A step runs the local
forward (ZeRO-3 parameters gathered a unit at a time, the next unit prefetched,
`runtime/zero3.py`), autograd's backward through the program's collectives (ZeRO-2 and ZeRO-3
gradients reduce-scattered asynchronously as soon as they are complete, waited for when the
backward ends; in the step's last backward the replicated gradients all-reduced in the plan's
buckets as they fill, `grad_sync.GradBuckets`), the optimizer on the local update tensors,
and one bucketed all-gather per mesh axes refreshing the ZeRO-2 parameters. An SFB weight
(`meshplan.runtime.sfb`) is kept whole like a replicated one, but its gradient arrives whole
from backward: nothing to synchronize.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from meshplan.cost.memory import ZERO_SCATTERS_IN_FLIGHT
from meshplan.capture.batch import (batch_shapes, batch_size, check_shapes, check_static,
                                    flatten_batch, present_tensors, split_microbatches)
from meshplan.capture.to_ir import capture
from meshplan.capture.trace import Traced
from meshplan.ir.graph import Graph
from meshplan.lower import local_ops
from meshplan.lower.microbatch import StepScales, program_input
from meshplan.lower.pipeline_program import recompute_layers
from meshplan.planner.recompute import Replay
from meshplan.lower.overlap import plan_units
from meshplan.lower.program import lower
from meshplan.lower.shards import MeshPos, even_weights, gathered, take_local
from meshplan.plan.plan import Plan
from meshplan.runtime.collectives import shard_sizes
from meshplan.runtime.comm import Comm, Pending, ProcessGroupComm
from meshplan.runtime.devices import generator_for
from meshplan.runtime.dropout import DropoutStream, stream_for
from meshplan.runtime.failure import StepGuard
from meshplan.runtime.grad_norm import clip_engines, clip_factor
from meshplan.runtime.grad_sync import (GradBuckets, accumulate, dtype_buckets,
                                        gather_params_into, settle)
from meshplan.lower.factored_stats import update_dims
from meshplan.runtime.adafactor import ShardedAdafactor
from meshplan.runtime.optim import OptimizerSpec, make_optimizer
from meshplan.runtime.step_casts import StepCasts
from meshplan.runtime.step_modes import autocast_for, recomputed, segmented
from meshplan.runtime import zero3
from meshplan.runtime.zero3 import Rematerializer, Unit, Units


class _Param:
    """One parameter on this rank: the tensor the program uses and the one the optimizer steps."""

    def __init__(self, name: str, node: str, local: torch.Tensor, mode: str,
                 axes: tuple[int, ...], comm: Comm) -> None:
        self.name, self.node, self.mode, self.axes = name, node, mode, axes
        local = local.to(comm.device)
        self.full_shape = tuple(local.shape)
        self.compute: torch.Tensor | None = None
        if self.whole:
            self.compute = local.detach().clone().requires_grad_(True)
            self.update = self.compute
        else:
            n, me = comm.group_size(axes), comm.group_index(axes)
            if mode == "zero2":
                # The optimizer steps my rows of the whole parameter in place (a view, so
                # ZeRO-2 holds the parameter once, as its memory model says).
                self.compute = local.detach().clone().requires_grad_(True)
                shard = torch.tensor_split(self.compute.detach(), n, dim=0)[me]
            else:
                shard = torch.tensor_split(local.detach(), n, dim=0)[me].clone()
            self.update = shard.requires_grad_(True)

    @property
    def whole(self) -> bool:
        """Whether the optimizer steps the tensor the program uses (no ZeRO shard)."""
        return self.mode in ("replicated", "sfb")

    @property
    def program_arg(self) -> torch.Tensor:
        """What the local program takes: the compute tensor, or a ZeRO-3 parameter's shard
        (the program gathers it)."""
        return self.update if self.mode == "zero3" else self.compute


class Trainer:
    """Trains with ``plan`` on the rank of ``comm``; ``step(batch) -> loss``.

    ``model`` holds the initial state (every rank passes the same state: each keeps its
    shards, on the communicator's device, ``comm.device``). ``weights`` optionally gives per-axis shard weights (uneven shards, e.g. a 3:1
    batch split on a (1, 2) mesh is ``((1.0,), (3.0, 1.0))``). ``captured`` reuses a capture
    of the same model (tracing is not thread-safe, so emulated ranks share one). Raises ValueError if the model's
    trace differs from the program the plan was made for. A step's batch may have another
    shape than ``example_batch`` (`serve`) unless ``other_shapes`` is false (a pipeline
    stage's trainer). ``local_batches``: each step is given this rank's rows of the global
    batch (`meshplan.data.rank_rows`, what `LocalBatchSampler` loads), not the whole batch;
    ``example_batch`` stays the global one.
    """

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable | None, example_batch: Any,
                 comm: Comm, *, weights: Sequence[Sequence[float]] | None = None,
                 captured: tuple[Traced, Graph] | None = None,
                 scales: StepScales | None = None,
                 layers: Mapping[str, int] | None = None, other_shapes: bool = True,
                 local_batches: bool = False,
                 pipeline: tuple[Plan, int] | None = None, dropout: bool = True) -> None:
        if plan.num_stages > 1:
            raise ValueError(
                f"this plan has {plan.num_stages} pipeline stages: run it with the pipeline "
                "runtime, meshplan.runtime.pipeline.PipelineTrainer (one per rank, with its "
                "stage's communicator and a point-to-point endpoint); Trainer runs one stage")
        if tuple(comm.mesh_shape) != tuple(plan.mesh_shape):
            raise ValueError(f"the plan is for a {plan.mesh_shape} mesh, the communicator has "
                             f"{comm.mesh_shape}")
        # The program is one micro-batch's: the plan was made on that size.
        micro = split_microbatches(example_batch, plan.microbatches)[0]
        traced, graph = captured or locked_capture(model, loss_fn, micro)
        if graph.fingerprint() != plan.graph_fingerprint:
            raise ValueError("this model's traced program differs from the one the plan was made "
                             "for (different model, shapes or batch); make a new plan")
        if weights and plan.segment_weights:
            raise ValueError("this plan cuts its model into segments, each with its own shard "
                             "weights (plan.segment_weights): give no weights")
        w = tuple(tuple(float(x) for x in a) for a in weights) if weights else \
            plan.axis_weights or even_weights(plan.mesh_shape)
        self.comm, self.plan, self.graph = comm, plan, graph
        self.device = comm.device
        self.pos = MeshPos(plan.mesh_shape, comm.rank, w)
        # The loss's batch reductions, scaled per micro-batch so that the step is the full
        # batch's (`lower/microbatch.py`); a pipeline's stages share their whole program's.
        # (One micro-batch is the whole batch: nothing to find.)
        if scales is None and plan.microbatches > 1:
            scales = StepScales(traced.graph_module, graph,
                                lambda: locked_capture(model, loss_fn, example_batch)[1])
        self.scales = scales
        scaled = tuple(r for r in scales.reductions if r.node in graph.by_name) \
            if scales is not None and plan.microbatches > 1 else ()
        self.program = lower(traced, graph, plan, comm.rank, w, device=self.device,
                             scaled=scaled)
        # Read while no rank traces: a capture swaps the module's tensors for fake ones while
        # it runs (another emulated rank's, re-tracing at another batch size for its dropout
        # masks, once handed this rank a FakeTensor parameter).
        with _CAPTURING:
            state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            self.params = [self._make_param(p.name, p.node, state) for p in plan.params]
            # The trainer's own copies: the forward's writes replace them (`_run`), and
            # ranks that share one model (emulated, threads) must not update it each.
            self.buffers = {n.name: state[n.state_name].detach().to(self.device).clone()
                            for n in graph.nodes if n.role == "buffer"}
        self._buffer_node = {n.state_name: n.name for n in graph.nodes if n.role == "buffer"}
        self.spec = OptimizerSpec.from_dict(plan.optimizer)
        self.optimizer = self._make_optimizer(self.spec)
        self._by_node = {p.node: p for p in self.params}
        # Under mixed precision each parameter's half-type copy is made once per step and
        # held, unless the plan could not fit them (`IntraOptions.hold_half_copies`).
        self._casts = StepCasts(p.program_arg for p in self.params) \
            if plan.options.get("hold_half_copies", True) else StepCasts(())
        self._layout = traced.batch
        self.planned_shapes = batch_shapes(example_batch)
        self._steps = 0
        self._units = self._make_units(graph)
        self._layers = layers
        self._layered = self._segments(graph, self.program)
        # Other batch shapes: the same decisions lowered again on the program traced at the
        # shape (`serve`), one program per shape.
        self._capture = (lambda b: locked_capture(model, loss_fn, b)) if other_shapes else None
        self._weights = w
        self._shape = shape_key(example_batch)
        self._programs = {self._shape: (graph, self.program, self.scales, self._layered)}
        # Several micro-batches draw the whole batch's dropout masks (`runtime/dropout.py`);
        # a pipeline's stages share their whole program's (``dropout`` False).
        self._own_dropout = dropout
        self._recapture = lambda b: locked_capture(model, loss_fn, b)
        self._streams = {self._shape: self._stream(traced, graph, example_batch)}
        self._dropout = self._streams[self._shape]
        self._structure = _structure(graph)
        self._local = None
        if local_batches:
            from meshplan.data import local_positions, rank_rows
            # A pipeline stage's rows are among those of every stage its rank runs.
            whole, rank = pipeline or (plan, comm.rank)
            rows = batch_size(example_batch)
            positions = local_positions(whole, rank, rows, stage=plan if pipeline else None)
            self._local = {k: torch.tensor(v, dtype=torch.long) for k, v in positions.items()}
            self._local_total = len(rank_rows(whole, rank, rows))
            # The batch tensors this program reads, by batch name (local batches keep the
            # planned shape, so this program).
            self._batch_nodes = {n.state_name: n.name for n in graph.nodes
                                 if n.role in ("input", "target") and n.state_name}
        self._zero3 = Rematerializer() if self._units is not None else None
        # ZeRO-2's reduce-scatters issued and not yet waited for, oldest first.
        self._scattering: deque[tuple[Pending, Callable[[torch.Tensor], None]]] = deque()
        for p in self.params:
            if p.mode == "zero2":
                p.compute.register_post_accumulate_grad_hook(self._scatter_hook(p))
        self._buckets = self._make_buckets()
        self._began = 0
        # The gradients synchronized since the last update (`synchronize_gradients`): a
        # second synchronization would reduce them again.
        self._synced = False
        # The scale the caller's backward gave a step part of whose backward ran unscaled
        # inside the model's call (`scale_loss`), applied at synchronization.
        self._loss_scale: torch.Tensor | None = None
        # The scale that backward inside the call runs at (`eager_scale`): the loop's scale of
        # the step before (a GradScaler's, a division by accumulation steps), so the half
        # precision gradients inside carry it as one device's backward does (a GradScaler's
        # guard against underflow, and its overflows where one device's overflow).
        self._eager_scale: torch.Tensor | None = None
        self._last_scale: torch.Tensor | None = None
        # A step failing on one rank fails alike on every rank (`runtime/failure.py`).
        self.guard = StepGuard([comm.rebuild] if isinstance(comm, ProcessGroupComm) else [],
                               self.undo_step, active=isinstance(comm, ProcessGroupComm))

    def _segments(self, graph: Graph, program: Any) -> Any:
        """``program`` cut into its recomputed segments (``layers``: each IR node's clustered
        layer), as the planner prices it (`planner/recompute.py`), or None: not recomputed, or
        a program of one layer, which reruns its forward as one piece."""
        plan, layers = self.plan, self._layers
        if not plan.recompute:
            return None
        replay = Replay(plan.recompute_scope, plan.recompute_layers)
        if replay.scope == "layers" and layers is None and plan.num_stages <= 1 \
                and plan.num_layers > 1:
            layers = self._layers = recompute_layers(graph, plan)   # a single stage's own
        segments = replay.segments(graph, layers or {}) \
            if replay.scope == "attention" or layers else {}
        if replay.scope == "attention" and not segments:
            raise ValueError("the plan recomputes attention cores, but this program has "
                             "none: the plan was made for another program; make a new plan")
        if not segments:
            return None
        owner = program.owner
        return segmented(program.graph_module, lambda name: segments.get(owner.get(name, "")),
                         owner.__contains__, self._around_segment)

    @contextmanager
    def _around_segment(self) -> Iterator[None]:
        """What a recomputed segment's run and replay need of the trainer: ZeRO-3's units and
        the step's parameter casts."""
        with zero3.running(self._units) if self._units is not None else nullcontext(), \
                self._casts.active():
            yield

    def serve(self, batch: Any) -> None:
        """Run the next steps on ``batch``'s shape: the plan's decisions lowered on the program
        traced at that shape (a batch size or sequence length other than the example's),
        once per shape. Every rank holds the same global batch, so every rank switches, or
        refuses, alike before communicating. Raises ValueError when the plan cannot serve it:
        its micro-batches do not divide the batch, or the shape changes the model's program
        (a micro-batch of one sample traces without its batch dim)."""
        if self._local is not None:
            self._check_local(batch)
            return
        key = shape_key(batch)
        if key == self._shape:
            return
        self.check_form(batch)
        if key not in self._programs:
            if self._capture is None:   # a pipeline stage's: its pipeline adopts the shape
                check_shapes(self.planned_shapes, batch)
            micro = split_microbatches(batch, self.plan.microbatches)[0]
            check_rows(micro, self.planned_shapes, self.plan.microbatches)
            traced, graph = self._capture(micro)
            scales = StepScales(traced.graph_module, graph, lambda: self._capture(batch)[1]) \
                if self.plan.microbatches > 1 else None
            self.adopt(key, traced, graph, scales, batch)
        self.use(key)

    def _check_local(self, batch: Any) -> None:
        """Raise ValueError unless ``batch`` is this rank's rows of a planned global batch,
        holding at least the tensors this stage reads."""
        flat = present_tensors(batch, self._layout)
        need = set(self._batch_nodes)
        if need - set(flat):
            raise ValueError(f"this rank reads the batch tensors {sorted(need)} "
                             "(meshplan.data.rank_tensors); the batch given lacks "
                             f"{sorted(need - set(flat))}")
        want = self._local_total
        got = sorted({t.shape[0] for t in flat.values() if t.dim()})
        if got and got != [want]:
            raise ValueError(f"with local batches this rank reads {want} rows of each global "
                             f"batch (meshplan.data.rank_rows), given {got[-1]}; other batch "
                             "shapes are served with global batches")

    def split(self, batch: Any) -> list[Any]:
        """The step's micro-batches of ``batch``: global ones, or with local batches this
        rank's rows of each, as its tensors by batch name."""
        if self._local is None:
            return split_microbatches(batch, self.plan.microbatches)
        flat = dict(present_tensors(batch, self._layout))
        m = self.plan.microbatches
        return split_microbatches(flat, m) if flat and m > 1 else [flat] * m

    def check_form(self, batch: Any) -> None:
        """Raise ValueError unless ``batch`` has the traced example batch's form (its tensors
        by name, its non-tensor keywords)."""
        if self._layout is not None:
            check_static(self._layout, flatten_batch(batch)[0])

    def adopt(self, key: tuple, traced: Traced, graph: Graph, scales: StepScales | None,
              batch: Any = None) -> None:
        """Lower the plan on ``graph`` (traced at the batch shape ``key``) for `use`. Raises
        ValueError if its program is not the planned one's but for sizes."""
        if _structure(graph) != self._structure:
            raise ValueError(
                f"at the batch shapes {dict(key)} the model traces to another program than at "
                f"the planned {self.planned_shapes} (its operations depend on the shape, as "
                "when a micro-batch holds one sample): make a plan with an example batch of "
                "this shape")
        scaled = tuple(r for r in scales.reductions if r.node in graph.by_name) \
            if scales is not None else ()
        program = lower(traced, graph, self.plan, self.comm.rank, self._weights,
                        device=self.device, scaled=scaled)
        self._programs[key] = (graph, program, scales, self._segments(graph, program))
        self._streams[key] = self._stream(traced, graph, batch)

    def use(self, key: tuple) -> None:
        """Run the program lowered for the batch shape ``key`` (`adopt`)."""
        self.graph, self.program, self.scales, self._layered = self._programs[key]
        self._dropout = self._streams[key]
        self._shape = key

    def _stream(self, traced: Traced, graph: Graph, batch: Any) -> DropoutStream | None:
        """The dropout masks of a step of several micro-batches of the global ``batch``, or
        None (one micro-batch draws the whole batch's masks itself; a pipeline stage's come
        from its pipeline)."""
        if not self._own_dropout or self.plan.microbatches == 1:
            return None
        return stream_for(traced.graph_module, graph, self.plan.dtype, self.plan.microbatches,
                          batch, self._recapture)

    def _make_units(self, graph: Graph) -> Units | None:
        """The plan's ZeRO-3 units over this rank's shards (`runtime/zero3.py`), or None."""
        groups, regather, scatter = plan_units(self.plan, graph)
        if not groups:
            return None
        by_node = self._by_node
        units = [Unit(self.comm, g.axes, [by_node[n].update for n in g.params],
                      [by_node[n].full_shape for n in g.params]) for g in groups]
        return Units(units, regather, scatter, self.plan.prefetch)

    def _make_buckets(self) -> GradBuckets:
        """The plan's gradient buckets over this rank's tensors (`lower/overlap.py`); a plan of
        an older meshplan has one per mesh axes and dtype, synchronized after the backward."""
        if self.plan.buckets:
            groups = [(g.axes, [self._by_node[n].compute for n in g.params])
                      for g in self.plan.buckets]
        else:
            groups = [(axes, [ps[i].compute for i in same])
                      for axes, ps in self._groups("replicated")
                      for same in dtype_buckets([p.compute for p in ps])]
        return GradBuckets(self.comm, groups)

    def _make_optimizer(self, spec: OptimizerSpec) -> Any:
        tensors = [p.update for p in self.params]
        if spec.kind != "adafactor":
            return make_optimizer(spec, tensors, [p.name for p in self.params])
        dims = [update_dims(self.program.values[p.node].layout.dims, p.mode, p.axes)
                for p in self.params]
        return ShardedAdafactor(spec, tensors, [self.program.values[p.node].shape
                                                for p in self.params], dims, self.comm)

    def _make_param(self, name: str, node: str, state: dict[str, torch.Tensor]) -> _Param:
        dec = self.plan.param(name)
        local = take_local(state[name].detach(), self.program.values[node], self.pos)
        return _Param(name, node, local, dec.update, tuple(dec.sync_axes), self.comm)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """The parameters and buffers of ``state`` (whole, by their names in the original
        model; others left as they are) taken as this rank's pieces, as the start took the
        model's; the optimizer's state is kept. Raises ValueError for a tensor of another shape
        than the plan's."""
        for p in self.params:
            want = tuple(self.program.values[p.node].shape)
            if p.name in state and tuple(state[p.name].shape) != want:
                raise ValueError(f"the state holds {p.name!r} at shape "
                                 f"{tuple(state[p.name].shape)}, this model's is {want}")
        with torch.no_grad():
            for p in self.params:
                if p.name not in state:
                    continue
                fresh = self._make_param(p.name, p.node, state)
                p.update.copy_(fresh.update)   # (ZeRO-2's update is a view of its compute)
                if p.compute is not None and fresh.compute is not None:
                    p.compute.copy_(fresh.compute)
            for name, node in self._buffer_node.items():
                if name in state:
                    self.buffers[node] = state[name].detach().to(
                        self.device, self.buffers[node].dtype).clone()
        self._casts.clear()   # half-type copies of the values replaced

    # ---------------------------------------------------------------- one step
    def local_batch(self, batch: Any) -> list[torch.Tensor]:
        """This rank's pieces of a global batch, in program order.

        ``batch`` has the form of the traced example batch (``capture/batch.py``): ``(inputs,
        target)`` or a dict of keyword arguments. Raises TypeError/ValueError if it does not.
        """
        if self._local is not None:   # this rank's tensors by name (`split`)
            full = batch
        else:
            layout, full = flatten_batch(batch)
            if self._layout is not None:
                check_static(self._layout, layout)
        out = []
        for n in self.graph.nodes:
            if n.role in ("input", "target") and n.state_name:
                t = full[n.state_name]
                if self._local is not None and t.dim():   # this rank's rows already
                    piece = take_local(t.index_select(0, self._local[n.name]),
                                       self.program.values[n.name], self.pos, have=(0,))
                else:
                    piece = take_local(t, self.program.values[n.name], self.pos)
                out.append(piece.to(self.device, non_blocking=True))
        return out

    def _program_args(self, batch_pieces: list[torch.Tensor],
                      received: dict[str, torch.Tensor] | None = None,
                      scales: dict[str, float | torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The program's arguments: the micro-batch's ``scales`` of the loss's batch
        reductions (`step_scales`), parameters, buffers, this rank's batch pieces and, in a
        pipeline stage, the local pieces of values ``received`` from earlier stages (inputs
        without a batch name)."""
        pieces = iter(batch_pieces)
        if self.program.scaled and scales is None:
            raise AssertionError("meshplan internal error: a micro-batch of a plan with "
                                 "scaled batch reductions ran without its scales")
        args = [program_input(scales[n], self.device) for n in self.program.scaled]
        for n in self.graph.nodes:
            if n.role == "param":
                args.append(self._by_node[n.name].program_arg)
            elif n.role == "buffer":
                args.append(self.buffers[n.name])
            elif n.role in ("input", "target"):
                args.append(next(pieces) if n.state_name else (received or {})[n.name])
        return args

    def _whole(self, p: _Param) -> torch.Tensor:
        """A ZeRO-3 parameter's local tensor gathered from its shards."""
        sizes = shard_sizes(p.full_shape[0], self.comm.group_size(p.axes))
        return self.comm.all_gather(p.update.detach(), p.axes, 0, sizes, phase="update")

    def step(self, batch: Any, *, seed: int | None = None) -> float:
        """One training step on the global ``batch``; returns the global loss.

        ``batch`` has the example batch's form: ``(inputs, target)`` or a dict of keyword
        arguments, every tensor split along dim 0 as planned. It runs as the plan's
        micro-batches (equal cuts along dim 0, gradients accumulated, one update), averaged
        with each of the loss's batch reductions scaled so that the step is one full-batch
        forward and backward: a sum counts whole, a cross-entropy mean divides by the real
        targets of the whole batch, not of its micro-batch (`lower/microbatch.py`).

        Dropout masks come from a generator seeded with ``seed`` (default: the step number),
        the same on every rank: the step equals single-device training run after
        ``torch.manual_seed(seed)``.
        """
        self.serve(batch)
        with self.guard.running():
            rng = self.begin_step(seed)
            micro = self.split(batch)
            scales = self.step_scales(micro)
            total = None
            for k, piece in enumerate(micro):
                loss = self.run_microbatch(piece, rng, scales[k], k)
                if k == len(micro) - 1:
                    self.last_backward()
                (loss / len(micro)).backward()
                self.own_gradients()
                total = loss.detach() if total is None else total + loss.detach()
            self.prepare_gradients()
            value = self._report(total / len(micro))
            self.guard.updating = True
            self.update()
        return value

    def run_microbatch(self, piece: Any, rng: torch.Generator | DropoutStream,
                       scales: dict[str, float | torch.Tensor] | None = None,
                       index: int = 0) -> torch.Tensor:
        """This rank's local loss of one global micro-batch ``piece`` (its share taken, the
        step's ``index``-th), its batch reductions by ``scales`` (`step_scales`)."""
        if isinstance(rng, DropoutStream):
            rng.set_state(index)
        return self._run(self._program_args(self.local_batch(piece), None, scales), rng)

    def step_scales(self, micro: Sequence[Any]) -> list[dict[str, float] | None]:
        """Per micro-batch of a step (global micro-batches, in order), the scales of the
        loss's batch reductions that make the step the full batch's (`lower/microbatch.py`);
        None each when the program has none."""
        if not self.program.scaled:
            return [None] * len(micro)
        if self._local is None:
            return self.scales(micro)
        return self.scales.of_tensors([self._whole_counted(m) for m in micro],
                                      self.program.scaled)

    def _whole_counted(self, piece: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With local batches: the global micro-batch's tensors the loss's scales are counted
        from (targets, masks), gathered from the ranks' rows over the axes that split them."""
        by_batch_name = self._batch_nodes
        out = {}
        n = len(self.comm.records)
        for name in self.scales.inputs_of(self.program.scaled):
            if name not in by_batch_name:
                raise NotImplementedError(
                    f"the loss's micro-batch scales are counted from the batch tensor "
                    f"{name!r}, which this pipeline stage does not read: give global batches")
            node = by_batch_name[name]
            t = piece[name].index_select(0, self._local[node]).to(self.device)
            axes = self.program.values[node].layout.dims[0]
            if axes:
                _, sizes = gathered(self.program.values[node], 0, axes, self.pos)
                t = self.comm.all_gather(t, axes, 0, sizes, phase="update")
            out[name] = t.cpu()
        del self.comm.records[n:]   # not the plan's: kept out of the record, as the loss's
        return out

    def last_backward(self) -> None:
        """The next backward is the step's last: its complete gradient buckets are
        all-reduced while it runs."""
        self._buckets.arm()

    def own_gradients(self) -> None:
        """After a micro-batch's backward: its ZeRO reduce-scatters waited for and added to the
        shards' gradients, and every parameter given a gradient tensor of its own.
        Autograd may hand one gradient tensor to two parameters (it steals an incoming gradient
        as ``.grad`` when it sees no other user; two batch-norm biases summed into one residual
        got the same tensor). The next micro-batch then accumulates into it in place twice:
        one parameter's part counted for both."""
        self._drain()
        seen: set[int] = set()
        for p in self.params:
            g = p.compute.grad if p.compute is not None else None
            if g is None or self._buckets.holds(p.compute):
                continue
            if g.untyped_storage().data_ptr() in seen:
                p.compute.grad = g.clone()
            else:
                seen.add(g.untyped_storage().data_ptr())

    def begin_step(self, seed: int | None = None) -> torch.Generator:
        """Before a step's micro-batches: the step's dropout generator (seeded ``seed``,
        default the step number)."""
        if self._synced:
            raise RuntimeError(
                "this step's gradients were synchronized (clip_grad_norm_) and not yet applied: "
                "another forward would add to them after the fact. Clip once the step's "
                "gradients are all accumulated, then optimizer.step() (or zero_grad() to drop "
                "them)")
        rng = generator_for(self.device).manual_seed(self._steps if seed is None else seed)
        self._began = self._steps
        self._steps += 1
        self._buckets.reset()
        self._casts.clear()
        self.guard.begin(self._began)
        return self._dropout.begin(rng) if self._dropout is not None else rng

    def undo_step(self) -> None:
        """What a failed step left, dropped (`runtime/failure.py`): gradients, transfers in
        flight, ZeRO-3 copies; the step count as before it."""
        self._scattering.clear()
        self._casts.clear()
        self.settled()
        for p in self.params:
            p.update.grad = None
            if p.compute is not None:
                p.compute.grad = None
        self._buckets.reset()
        if self._units is not None:
            self._units.reset()
        self.comm.recomputing = False
        self._steps = self._began

    def apply_gradients(self) -> None:
        """After a step's backwards: `prepare_gradients`, then the update applied and ZeRO-2
        compute copies refreshed. The pipeline runtime and `meshplan.parallelize` call the
        parts themselves."""
        self.prepare_gradients()
        self.update()

    def prepare_gradients(self) -> None:
        """Gradients synchronized in buckets, then clipped to the optimizer's
        ``max_grad_norm``."""
        self.synchronize_gradients()
        total = self.squared_norm()
        if total is not None:
            self.clip(total)

    def synchronize_gradients(self) -> None:
        """Gradients synchronized over the mesh in buckets (ZeRO: reduce-scattered), once per
        step: a clip before the optimizer's step synchronizes them first."""
        if not self._synced:
            self._synchronize()
            scale = self._loss_scale
            if scale is not None and self._eager_scale is not None:
                scale = scale / self._eager_scale
            if scale is not None and not bool((scale == 1).all()):
                self.scale_gradients(scale)
            self._synced = True

    def settled(self) -> None:
        """The step's gradients were applied or dropped: the next are synchronized anew."""
        self._synced = False
        self._loss_scale = self._eager_scale = None

    def scale_loss(self, grad: torch.Tensor) -> None:
        """The gradient ``grad`` the caller's ``loss.backward()`` gave a loss it scaled
        (divided by gradient-accumulation steps) where part of the call's backward ran inside
        it with the loss as returned (earlier micro-batches, a pipeline's schedule): gradients
        are linear in it, so the step's gradients take it once, at synchronization, and the
        rest of the backward runs unscaled. That needs every call of a step scaled alike, as
        the loops that scale do; raises ValueError where a call's scale differs."""
        grad = grad.detach()
        if grad.device.type == "meta":   # shapes only: nothing to scale
            return
        self.eager_scale()   # fixed before this step's scale is known
        self._last_scale = grad.clone()
        if self._loss_scale is None:
            self._loss_scale = grad.clone()
        elif not bool((grad == self._loss_scale).all()):
            raise ValueError(
                f"loss.backward() was given a gradient of {grad.flatten()[0].item():g}, and "
                f"an earlier call of this step {self._loss_scale.flatten()[0].item():g}: this "
                "plan runs part of each call's backward inside the call and applies the "
                "loop's scale to the step's gradients at once, which needs every call of a "
                "step scaled alike. Scale each call's loss alike, or call backward on the loss "
                "as returned and let the plan accumulate (plan the larger batch)")

    def eager_scale(self) -> torch.Tensor:
        """The scale this step's backward runs at inside the model's call: the loop's scale
        of the last step that gave one (1 before), the same for every call of a step;
        `synchronize_gradients` takes the ratio of the step's own to it. A 0-dim fp32 tensor
        (a loss times it promotes as one device's ``scaler.scale(loss)`` does)."""
        if self._eager_scale is None:
            last = self._last_scale
            self._eager_scale = torch.ones((), device=self.device) if last is None else \
                last.to(torch.float32).reshape(())
        return self._eager_scale

    def update(self) -> None:
        """The optimizer step on the synchronized (and clipped) gradients; ZeRO-2 compute copies
        refreshed."""
        self._casts.clear()   # the casts of the values the optimizer replaces
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._refresh_zero2()
        self.settled()

    def _run(self, args: list[torch.Tensor], rng: torch.Generator) -> torch.Tensor:
        """The local program on one micro-batch, at the plan's dtype, recomputed in backward
        when the plan says so."""
        with local_ops.buffer_writes() as written:
            out = self._forward(args, rng)
        # The forward's buffer writes, as one device's forward makes them: the next
        # micro-batch reads them. Replaced, not written into: a replay in backward reads the
        # tensors its forward read.
        for name, value in written.items():
            self.buffers[self._buffer_node[name]] = value
        return out

    def _forward(self, args: list[torch.Tensor], rng: torch.Generator) -> torch.Tensor:
        def program(*a: torch.Tensor) -> torch.Tensor:
            with zero3.running(self._units) if self._units is not None else nullcontext():
                return self.program.graph_module(self.comm, rng, *a)

        # A backward whose reduce-scatters nobody waited for yet (a caller accumulating
        # gradients over several calls of its own): finished before the next forward.
        self._drain()
        # (Recomputed by layer, a checkpoint holds a gathered unit a later layer reads: the
        # plan gathers none again in backward, so none is packed away.)
        keep_shards = self._zero3.hooks() if self._zero3 is not None and \
            self._layered is None else nullcontext()
        with keep_shards, autocast_for(self.plan.dtype, self.device.type), self._casts.active():
            if not self.plan.recompute:
                return program(*args)
            if self._layered is not None:   # each segment checkpointed on its own
                return self._layered(self.comm, rng, *args)
            return recomputed(program, args, rng, self.comm)

    def squared_norm(self, counted_elsewhere: frozenset[str] = frozenset()
                     ) -> torch.Tensor | None:
        """The squared global norm of this mesh's update gradients (`norm_part`), or None
        without the optimizer's clipping."""
        if self.spec.max_grad_norm is None:
            return None
        return self.norm_part(2.0, counted_elsewhere)

    def norm_part(self, norm_type: float, counted_elsewhere: frozenset[str] = frozenset()
                  ) -> torch.Tensor:
        """This mesh's part of the update gradients' global ``norm_type``-norm (fp64, the same
        on every rank): the sum of ``|g| ** norm_type``, or for inf the largest ``|g|``. For
        the sum each rank adds its pieces' powers divided by how many ranks hold the same piece
        (the mesh over the distinct pieces: the layout's shards, times the ZeRO shards), so the
        all-reduce over the mesh counts every element once. ``counted_elsewhere``: parameters
        another pipeline stage counts."""
        r, c = self.plan.mesh_shape
        largest = math.isinf(norm_type)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            g = p.update.grad
            if g is None or p.name in counted_elsewhere or g.numel() == 0:
                continue
            g = g.detach().double()
            if largest:
                local = torch.maximum(local, g.abs().max())
                continue
            pieces = self.program.values[p.node].layout.shard_factor((r, c))
            if not p.whole:
                pieces *= self.comm.group_size(p.axes)
            power = g.pow(2) if norm_type == 2.0 else g.abs().pow(norm_type)
            local = local + power.sum() / (r * c // pieces)
        n = len(self.comm.records)   # not part of the plan's collectives, like the loss report
        if largest:
            total = self.comm.all_gather(local.reshape(1), (0, 1), 0, [1] * (r * c),
                                         phase="update").max()
        else:
            total = self.comm.all_reduce(local, (0, 1), phase="update")
        del self.comm.records[n:]
        return total

    def clip(self, total: torch.Tensor) -> None:
        """Scale the update gradients to the optimizer's ``max_grad_norm`` given the squared
        global norm ``total`` (bitwise the same on every rank, so every rank scales alike)."""
        limit = self.spec.max_grad_norm
        assert limit is not None
        self.scale_gradients(clip_factor(total.sqrt(), limit))

    def scale_gradients(self, factor: torch.Tensor) -> None:
        """Every update gradient times ``factor`` (a 0-dim tensor)."""
        for p in self.params:
            if p.update.grad is not None:
                p.update.grad.mul_(factor.to(p.update.grad.dtype))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """The step's gradients synchronized, clipped to ``max_norm`` by their global norm as
        one device clips (`runtime/grad_norm.py`); returns that norm (fp64)."""
        self.synchronize_gradients()
        return clip_engines(self.norm_part(norm_type), norm_type, max_norm, error_if_nonfinite,
                            [self])

    def _groups(self, mode: str) -> list[tuple[tuple[int, ...], list[_Param]]]:
        """The synchronized parameters of update ``mode`` by mesh axes (one bucket each)."""
        groups: dict[tuple[int, ...], list[_Param]] = defaultdict(list)
        for p in self.params:
            if p.axes and p.mode == mode:
                groups[p.axes].append(p)
        return sorted(groups.items())

    def _scatter_hook(self, p: _Param) -> Callable[[torch.Tensor], None]:
        """ZeRO-2: once a micro-batch's gradient of ``p`` is complete, reduce-scatter it into
        the update shard's gradient, so the whole gradient lives only until then."""
        comm, sizes = self.comm, shard_sizes(p.full_shape[0], self.comm.group_size(p.axes))
        # Weakly: the tensor keeps its hook, and a strong reference back to the parameter
        # would be a cycle through C++ that Python's collector cannot free.
        ref, axes, issued = weakref.ref(p), p.axes, self._scattering

        def add(piece: torch.Tensor) -> None:
            mine = ref()
            assert mine is not None   # the trainer holds its parameters while it runs
            accumulate(mine.update, piece)

        def hook(param: torch.Tensor) -> None:
            with torch.no_grad():
                # Sent from the gradient itself: nothing else holds it once it is let go.
                issued.append((comm.reduce_scatter_async(param.grad, axes, 0, sizes,
                                                         phase="backward", donate=True), add))
                param.grad = None
            settle(issued, ZERO_SCATTERS_IN_FLIGHT)
        return hook

    def _drain(self) -> None:
        """ZeRO reduce-scatters issued in backward, waited for and added to the shards'
        gradients (in the order they were issued)."""
        if self._units is not None:
            self._units.end_backward()
        settle(self._scattering, 0)

    def _synchronize(self) -> None:
        # ZeRO-2 and ZeRO-3 gradients were reduce-scattered in backward: waited for here.
        self._drain()
        self._buckets.finish()   # first: it gives its tensors without a gradient their zeros
        for p in self.params:
            if p.whole and p.compute.grad is None:
                p.compute.grad = torch.zeros_like(p.compute)

    def _refresh_zero2(self) -> None:
        for axes, ps in self._groups("zero2"):
            gather_params_into(self.comm, [p.update.detach() for p in ps],
                               [p.compute.detach() for p in ps], axes)
            for p in ps:
                p.compute.grad = None

    def _report(self, loss: torch.Tensor) -> float:
        # The loss-reporting all-reduce is not part of the plan: keep it out of the record.
        n = len(self.comm.records)
        if self.program.loss_partial:
            loss = self.comm.all_reduce(loss, self.program.loss_partial, phase="update")
        del self.comm.records[n:]
        return float(loss)

    # ---------------------------------------------------------------- inspection
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole on every rank (for checks; not recorded), and every
        buffer the program reads (whole on every rank), by their names in the model."""
        n = len(self.comm.records)
        out = {}
        for p in self.params:
            t = self._whole(p) if p.mode == "zero3" else \
                p.update.detach() if p.whole else p.compute.detach()
            out[p.name] = self._gather_spec(t, p.node)
        del self.comm.records[n:]
        for state_name, node in self._buffer_node.items():
            out[state_name] = self.buffers[node]
        return out

    def _gather_spec(self, t: torch.Tensor, node: str) -> torch.Tensor:
        v = self.program.values[node]
        for d, axes in enumerate(v.layout.dims):
            if axes:
                v, sizes = gathered(v, d, axes, self.pos)
                t = self.comm.all_gather(t, axes, d, sizes, phase="update")
        return t


def check_rows(micro: Any, planned: Mapping[str, tuple[int, ...]], microbatches: int) -> None:
    """Raise ValueError when a micro-batch holds one sample and the planned ones more (or the
    other way): a sample alone traces without its batch dim, another program."""
    rows = batch_size(micro)
    planned_rows = next(iter(planned.values()))[0] // microbatches if planned else rows
    if (rows == 1) != (planned_rows == 1):
        raise ValueError(f"this batch makes micro-batches of {rows} sample(s), the plan's hold "
                         f"{planned_rows}: a micro-batch of one sample traces to another "
                         "program; give a batch of at least 2 samples per micro-batch, or make "
                         "a plan with an example batch of this shape")


def shape_key(batch: Any) -> tuple:
    """The shapes of ``batch``'s tensors, as a key of the programs lowered per shape."""
    return tuple(sorted(batch_shapes(batch).items()))


_CAPTURING = threading.Lock()


def locked_capture(model: nn.Module, loss_fn: Callable | None, batch: Any) -> tuple:
    """`capture`, one at a time: tracing is not thread-safe, and emulated ranks are threads."""
    with _CAPTURING:
        return capture(model, loss_fn, batch)


def _structure(graph: Graph) -> tuple:
    """The program without its sizes: what a plan's decisions are made on."""
    return tuple((n.name, n.role, n.op, n.inputs) for n in graph.nodes)
