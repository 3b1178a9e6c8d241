"""Costs of one op's choice and of moving its operands: shared by the ILP's formulation, the
plan's extraction and the baselines.

`CostContext` is the mesh costs are measured on; `OpCosts` prices, for one graph's choices,
compute (roofline, forward + backward), an op's own statistics exchange, resharding recipes
(`reshard.py`) and memory. All in seconds, or in abstract α/β units when compute is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from meshplan.cost.collectives import collective_cost
from meshplan.cost.compute import backward_factor, forward_backward_times
from meshplan.cost.devices import DeviceType
from meshplan.cost.memory import (OptimizerState, ParamMemory, param_memory_per_device,
                                  unsharded_state_bytes, updated_elements)
from meshplan.cost.mesh import LogicalMesh
from meshplan.cost.precision import HALF_TYPES, runs_half
from meshplan.ir.graph import DTYPE_BYTES, Graph, Node
from meshplan.planner.intra.choices import Choice, NodeChoices
from meshplan.planner.intra.layout import Axes, Layout, active_axes
from meshplan.planner.intra.reshard import Recipe, Step, reshard
from meshplan.planner.intra.sfb import SfbUse, sfb_uses


@dataclass(frozen=True)
class CostContext:
    """The mesh costs are measured on; ``device`` None leaves compute out (abstract units).

    A step runs the program once per micro-batch (``microbatches``; the graph is traced at the
    micro-batch's size), with its forward run again during backward under ``recompute`` (only
    the nodes of ``recomputed`` when it is given: `planner/recompute.py`); the update-phase
    synchronization runs once per step.

    ``devices`` (a mixed cluster: each rank's type, host-major as the mesh numbers them) prices
    an op at its slowest rank, each rank doing its share of the work (the mesh's weights);
    empty: every rank is ``device``."""

    mesh: LogicalMesh
    device: DeviceType | None
    optimizer: OptimizerState = OptimizerState()
    param_reshard: bool = False  # may a parameter be resharded before a use (GSPMD-style)?
    microbatches: int = 1
    recompute: bool = False
    devices: tuple[DeviceType, ...] = ()
    recomputed: frozenset[str] | None = None
    # Whether a step holds its parameters' half-type copies (`IntraOptions.hold_half_copies`):
    # their memory, and a weight's forward cast once per step rather than per use.
    half_copies: bool = True

    def replays(self, node: str | None = None) -> bool:
        """Whether ``node``'s forward runs again in backward (None: the program's, as a
        whole-program recomputation does)."""
        return self.recompute and (self.recomputed is None or node is None
                                   or node in self.recomputed)

    def rank_shares(self, axes: Axes) -> tuple[tuple[DeviceType, float], ...]:
        """The distinct (device type, share of the work) of the ranks when work is divided over
        ``axes``: one entry on an even mesh of one type. Remembered per axes: a formulation asks
        once per node and work axes, and each answer walks every rank (64 on HAP's cluster)."""
        memo = self.__dict__.setdefault("_rank_shares", {})   # not a field: eq and hash as before
        if axes in memo:
            return memo[axes]
        shape = self.mesh.shape
        types = self.devices or (self.device,) * (shape[0] * shape[1])
        per_axis = [self.mesh.shares((a,)) if a in axes else (1.0,) * shape[a] for a in (0, 1)]
        memo[axes] = out = tuple(dict.fromkeys(
            (types[i * shape[1] + j], per_axis[0][i] * per_axis[1][j])
            for i in range(shape[0]) for j in range(shape[1])))
        return out

    def phase_counts(self, phase: str, node: str | None = None) -> tuple[tuple[str, int], ...]:
        """How often per step a collective the program issues in ``phase`` (while running
        ``node``) runs, by the phase it is recorded in: forward ones again as "recompute" where
        ``node`` is replayed."""
        if phase == "update":
            return (("update", 1),)
        if phase == "forward" and self.replays(node):
            return (("forward", self.microbatches), ("recompute", self.microbatches))
        return ((phase, self.microbatches),)

    @property
    def weights(self) -> tuple[float, float]:
        """Per-step multiples of the program's (forward, backward) collectives."""
        return self.weights_of(None)

    def weights_of(self, node: str | None) -> tuple[float, float]:
        """Per-step multiples of the (forward, backward) collectives issued running ``node``."""
        return (float(sum(n for _, n in self.phase_counts("forward", node))),
                float(self.microbatches))

    @property
    def tie_break(self) -> float:
        """Cost per byte of memory added to the objective so that, of plans with equal
        communication, the one using less memory wins (a batch is split where it is consumed
        split rather than replicated and sliced). A billionth of moving the byte once: far
        below any real cost difference; the plan reports the objective without it."""
        return 1e-9 * min(b for b in self.mesh.beta if b > 0) if any(self.mesh.beta) else 0.0


def param_roots(graph: Graph) -> dict[str, str]:
    """Values that are a parameter seen through views only, mapped to that parameter."""
    out: dict[str, str] = {}
    for n in graph.nodes:
        if n.role == "param":
            out[n.name] = n.name
        elif (n.sig is not None and n.sig.kind == "view" and len(n.inputs) == 1
              and n.inputs[0] in out):
            out[n.name] = out[n.inputs[0]]
    return out


def is_kept(node: Node) -> bool:
    """Whether a value takes memory of its own for the step: batch tensors, and op outputs
    autograd keeps for backward (``node.kept``, from capture; where capture could not tell,
    every differentiable op output). A view (reshape, permute, slice) shares its base's
    storage, which is charged where the base is."""
    if node.role in ("input", "target"):
        return True
    if node.role == "op" and node.kept is not None:
        return node.kept
    return node.role == "op" and node.requires_grad and not (
        node.sig is not None and node.sig.kind == "view")


def unsharded_bytes(graph: Graph, state: OptimizerState) -> tuple[float, float]:
    """(parameter state, activations one micro-batch keeps) of ``graph`` held whole on one
    device: divided by the devices, a lower bound of any plan's share (sharding only divides
    a value, recomputation only drops one)."""
    params = (n.out.shape for n in graph.nodes if n.role == "param")
    return (unsharded_state_bytes(params, state),
            float(sum(n.out.nbytes for n in graph.nodes if is_kept(n))))


def dp_axes(layout: Layout, mesh_shape: tuple[int, ...]) -> Axes:
    """Active axes a parameter is replicated over: where ZeRO shards it."""
    return tuple(a for a in active_axes(mesh_shape) if a not in layout.split_axes)


def step_cost(step: Step, needs_grad: bool, mesh: LogicalMesh,
              weights: tuple[float, float] = (1.0, 1.0)) -> float:
    """Forward and (if a gradient flows) backward collectives of one resharding step, each
    phase counted ``weights`` = (forward, backward) times."""
    return sum(collective_cost(kind, mesh, step.axes, step.nbytes)
               * weights[phase == "backward"] for kind, phase in step.collectives(needs_grad))


@lru_cache(maxsize=None)
def recipe_cost(recipe: Recipe, needs_grad: bool, mesh: LogicalMesh,
                weights: tuple[float, float] = (1.0, 1.0)) -> float:
    return sum(step_cost(s, needs_grad, mesh, weights) for s in recipe.steps)


def zero_counts(mode: str, ctx: CostContext, kept: bool) -> tuple[tuple[str, str, int], ...]:
    """``(kind, phase, count)`` per step of one ZeRO parameter's collectives, as the runtime
    issues them. Both reduce-scatter the gradient in every backward, as soon as it is
    complete. ZeRO-2 then gathers the updated shards once per step (bucketed, `runtime/
    trainer.py`); ZeRO-3 (`runtime/zero3.py`) gathers the parameter in every forward (and its
    replay), and again in every backward when autograd keeps it (not under recomputation: the
    replayed forward gathered it). The runtime gathers ZeRO-3 parameters by units of a block
    (`lower/overlap.py`), each unit's collectives these with one latency for all its members;
    the ILP, pricing each parameter alone, charges each its own (an upper bound)."""
    scatter = ("reduce_scatter", "backward", ctx.microbatches)
    if mode == "zero2":
        return scatter, ("all_gather", "update", 1)
    out = [("all_gather", label, n) for label, n in ctx.phase_counts("forward")]
    if kept and not ctx.recompute:
        out.append(("all_gather", "backward", ctx.microbatches))
    return (*out, scatter)


@lru_cache(maxsize=None)
def sync_cost(mode: str, axes: Axes, nbytes: int, mesh: LogicalMesh,
              zero: tuple[tuple[str, str, int], ...] = (), bucketed: bool = False) -> float:
    """Gradient synchronization of one parameter's local tensor over ``axes``: an all-reduce
    once per step for a replicated update, ``zero`` (`zero_counts`) for ZeRO-2 and -3.

    ``bucketed``: the update phase's collectives are charged without their latency. The
    runtime runs them as one bucket per kind and axes, whose one latency is shared by every
    parameter in it; charged per parameter (Alpa's objective, kept in abstract α-β units),
    a model of a hundred parameters pays a hundred latencies that never happen, which on a
    slow network makes data parallelism look dearer than it is."""
    if not axes:
        return 0.0

    def cost(kind: str, phase: str) -> float:
        full = collective_cost(kind, mesh, axes, nbytes)
        return full - collective_cost(kind, mesh, axes, 0) if bucketed and phase == "update" \
            else full

    if mode == "replicated":
        return cost("all_reduce", "update")
    return sum(n * cost(kind, phase) for kind, phase, n in zero)


def local_bytes(node: Node, layout: Layout, mesh_shape: tuple[int, ...]) -> int:
    return node.out.nbytes // layout.shard_factor(mesh_shape)


class OpCosts:
    """Cost evaluation shared by the ILP build and the plan's per-op explanation."""

    def __init__(self, nc: NodeChoices, ctx: CostContext) -> None:
        self.nc, self.ctx, self.g = nc, ctx, nc.graph
        self.shape = tuple(ctx.mesh.shape)
        self.param_root = param_roots(self.g)
        self._times: dict[tuple[str, Axes], tuple[float, float]] = {}
        self._sfb: dict[str, SfbUse] | None = None

    @property
    def sfb(self) -> dict[str, SfbUse]:
        """The parameters sufficient-factor broadcasting can update, with their use."""
        if self._sfb is None:
            self._sfb = sfb_uses(self.g)
        return self._sfb

    def operand_recipe(self, node: Node, j: int, pu: int, qv: int) -> Recipe:
        u = self.g.by_name[node.inputs[j]]
        src = self.nc.choices[u.name][pu].strategy.output
        strat = self.nc.choices[node.name][qv].strategy
        return reshard(src, strat.inputs[j], u.out.nbytes, self.shape, strat.grad_partial[j],
                       u.requires_grad, u.name in self.param_root)

    def stat_sync(self, node: Node, choice: Choice) -> tuple[tuple[str, int, Axes, str], ...]:
        """The op's own statistics all-reduce (batch norm over a split batch), forward and, when
        a gradient flows, backward: (kind, bytes, axes, phase) entries."""
        strat, sig = choice.strategy, node.sig
        if not strat.sync_axes or sig is None or sig.sync is None:
            return ()
        amap = dict(strat.assign)
        cut = 1
        for atom in sig.sync.stat_atoms:
            for a in amap.get(atom, ()):
                cut *= self.shape[a]
        nbytes = sig.sync.nbytes // cut
        group = 1
        for a in strat.sync_axes:
            group *= self.shape[a]
        out = []
        for kind, backward in sig.sync.collectives:
            size = nbytes * group if kind == "all_gather" else nbytes  # B: the gathered whole
            out.append((kind, size, strat.sync_axes, "forward"))
            if backward != "none" and node.requires_grad:
                out.append((backward, size, strat.sync_axes, "backward"))
        return tuple(out)

    def stat_sync_cost(self, node: Node, choice: Choice) -> float:
        w = self.ctx.weights_of(node.name)
        return sum(collective_cost(k, self.ctx.mesh, a, b) * w[phase == "backward"]
                   for k, b, a, phase in self.stat_sync(node, choice))

    def pass_times(self, node: Node, choice: Choice) -> tuple[float, float]:
        """Seconds of one micro-batch's forward and backward of ``node`` on one device, its
        operands' casts to the half type included (`cast_times`)."""
        if self.ctx.device is None or node.is_source or node.flops == 0:
            return 0.0, 0.0
        key = (node.name, choice.strategy.work_axes)
        if key not in self._times:
            self._times[key] = self._pass_times(node, key[1])
        forward, backward = self._times[key]
        if node.out.dtype in HALF_TYPES and runs_half(node):
            cast_f, cast_b = self.cast_times(node, choice)
            return forward + cast_f, backward + cast_b
        return forward, backward

    def cast_times(self, node: Node, choice: Choice) -> tuple[float, float]:
        """Seconds of one micro-batch's casts of the fp32 operands of ``node``, an op mixed
        precision runs at the half type (a contraction, a split-off bias add): the runtime
        casts each operand where it is used (`lower/program.py`) and autograd casts its
        gradient back, each a memory-bound kernel of its own (4 bytes read and 2 written per
        element, or the reverse), which the op's own roofline does not hide. Where the step
        holds its half copies (`CostContext.half_copies`) a parameter's cast is made once per
        step (`runtime/step_casts.py`): a micro-batch pays its share. (A ZeRO-3 parameter's is
        made per gathered use; priced as a held one's.)"""
        once = self.ctx.half_copies
        forward = backward = 0.0
        for j, name in enumerate(node.inputs):
            u = self.g.by_name[name]
            if u.out.dtype != "float32":
                continue
            nbytes = 6.0 * u.out.numel / choice.strategy.inputs[j].shard_factor(self.shape)
            forward += nbytes / self.ctx.microbatches if once and name in self.param_root \
                else nbytes
            backward += nbytes if u.requires_grad else 0.0
        return forward / self._slowest_memory, backward / self._slowest_memory

    @cached_property
    def _slowest_memory(self) -> float:
        """Bytes/s of device memory on the slowest rank (memory-bound work every rank does)."""
        return min(d.effective_mem_bandwidth for d in self.ctx.devices or (self.ctx.device,))

    def _pass_times(self, node: Node, axes: Axes) -> tuple[float, float]:
        dtype = node.out.dtype if node.out.dtype in HALF_TYPES else "float32"
        factor = backward_factor(node.op, node.sig.kind if node.sig is not None else None)
        times = [forward_backward_times(node.flops * share, node.nbytes * share, device, dtype,
                                        factor)
                 for device, share in self.ctx.rank_shares(axes)]
        return max(t[0] for t in times), max(t[1] for t in times)

    def sfb_extra_s(self, node: Node, axes: Axes) -> float:
        """Seconds per step SFB adds to ``node`` whose work is divided over ``axes``: its
        weight gradient (one forward's FLOPs) over the whole batch on every device instead of
        over the device's share, at the slowest rank."""
        if self.ctx.device is None or node.flops == 0:
            return 0.0
        dtype = node.out.dtype if node.out.dtype in HALF_TYPES else "float32"

        def forward(device: DeviceType, share: float) -> float:
            return forward_backward_times(node.flops * share, node.nbytes * share, device,
                                          dtype, 2.0)[0]
        return self.ctx.microbatches * max(forward(d, 1.0) - forward(d, share)
                                           for d, share in self.ctx.rank_shares(axes))

    def compute_cost(self, node: Node, choice: Choice) -> float:
        forward, backward = self.pass_times(node, choice)
        return self.ctx.microbatches * (forward * (1 + self.ctx.replays(node.name)) + backward)

    def update_cost(self, node: Node, choice: Choice) -> float:
        """Seconds per step of the optimizer's update of the parameter ``node`` under
        ``choice``, on its slowest device: the elements the device updates (its shard; under
        ZeRO its share of that) through device memory once
        (`OptimizerState.update_bytes_per_element`). 0 for other nodes and in abstract units."""
        if self.ctx.device is None or node.role != "param":
            return 0.0
        lay = choice.strategy.output
        dp = math.prod(self.shape[a] for a in dp_axes(lay, self.shape))
        elems = updated_elements(node.out.numel, choice.mode or "replicated",
                                 lay.shard_factor(self.shape), dp)
        nbytes = elems * self.ctx.optimizer.update_bytes_per_element(node.out.shape)
        return nbytes / self._slowest_memory

    def param_memory(self, node: Node, choice: Choice) -> ParamMemory:
        """What a device holds of the parameter ``node`` under ``choice``."""
        lay = choice.strategy.output
        dp = 1
        for a in dp_axes(lay, self.shape):
            dp *= self.shape[a]
        return param_memory_per_device(
            node.out.numel, choice.mode or "replicated", lay.shard_factor(self.shape), dp,
            optimizer_bytes_per_param=self.ctx.optimizer.bytes_per_element(node.out.shape))

    def memory(self, node: Node, choice: Choice) -> float:
        lay = choice.strategy.output
        if node.role == "param":
            return self.param_memory(node, choice).total + self.half_copy(node, choice)
        if node.role == "buffer":   # whole on every rank (a frozen parameter too)
            return float(node.out.nbytes)
        if is_kept(node):
            return float(local_bytes(node, lay, self.shape))
        return 0.0

    def half_copy(self, node: Node, choice: Choice) -> float:
        """Bytes of the half-type copy of the parameter ``node`` that mixed precision holds
        through a step (`runtime/step_casts.py`) where a contraction or split-off bias add
        reads it: its compute shard at the half type. None where the step holds none
        (`CostContext.half_copies`), nor for a ZeRO-3 parameter, whose cast is of its
        gathered copy, counted with that."""
        size = self._cast_params.get(node.name)
        if size is None or choice.mode == "zero3" or not self.ctx.half_copies:
            return 0.0
        return size * node.out.numel / choice.strategy.output.shard_factor(self.shape)

    @cached_property
    def _cast_params(self) -> dict[str, int]:
        """The parameters a half-type op reads (through views), with the half type's bytes."""
        out = {}
        for n in self.g.nodes:
            if n.out.dtype in HALF_TYPES and runs_half(n):
                for name in n.inputs:
                    p = self.param_root.get(name)
                    if p is not None and self.g.by_name[p].out.dtype == "float32":
                        out[p] = DTYPE_BYTES[n.out.dtype]
        return out

    def working(self, node: Node, choice: Choice) -> float:
        """Bytes held only while a pass runs: a ZeRO parameter's whole gradient until its
        reduce-scatter, and under ZeRO-3 the parameter whole too (`meshplan.runtime.zero3`)."""
        lay = choice.strategy.output
        if node.role != "param" or choice.mode not in ("zero2", "zero3") \
                or not dp_axes(lay, self.shape):
            return 0.0
        return (2.0 if choice.mode == "zero3" else 1.0) * local_bytes(node, lay, self.shape)
