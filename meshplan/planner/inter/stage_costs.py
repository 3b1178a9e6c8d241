"""Stage costs for the stage–submesh DP: each layer range on each submesh, priced by the
intra-operator ILP on every logical shape of the submesh (Alpa §5.2's profiling, done on the
cost model instead of on hardware).

For a stage ``[start, end)`` on a submesh of ``hosts x devices`` the profiler builds the stage's
program (`stage_graph`), and for each logical mesh shape of ``hosts * devices`` devices solves
the ILP with the step's micro-batch count, so its objective is B x (forward + backward of one
micro-batch) + one update. A `StageOption` per plan found:

- ``latency``: objective / B (the update amortized over the micro-batches) plus the activations
  received and their gradients sent back over the link between stages;
- ``state_bytes``: parameters, gradients, optimizer state per device;
- ``activation_bytes``: what one in-flight micro-batch keeps per device.

Each shape gives the time-optimal plan and, when that one needs more than the device holds with
one micro-batch in flight, the fastest plan that fits (the ILP under that budget). Each plan
also comes recomputed (only the stage's inputs kept per micro-batch, its activations once, for
the micro-batch in backward; the forward runs twice), used by the DP where memory demands it.
Costs are cached by the stage's structure (`structure_key`), so repeated blocks are solved
once per (structure, submesh, logical shape): Alpa's reuse of identical layer ranges. Ranges of
more than two layers are priced as sums of one-layer solves (`_telescoped`), so the solves grow
with the distinct layers, not with L²; the stages the DP picks are then solved whole. Each layer is also priced at its leanest (the fastest plan within 5 % of its smallest
memory: ZeRO, tensor parallelism), so a long range has a lean variant too; a chosen lean stage is
solved whole under the device-memory limit, or at its own leanest where that limit is
infeasible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cost.cluster import Cluster
from meshplan.cost.mesh import factor_pairs, logical_mesh
from meshplan.cost.precision import with_compute_dtype
from meshplan.errors import InfeasibleIlpError
from meshplan.ir.graph import Graph
from meshplan.planner.inter.clustering import Layering
from meshplan.planner.inter.stage_graph import stage_graph, structure_key
from meshplan.planner.inter.stage_problem import StageOption, Submesh
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import CostContext, Formulation, formulate
from meshplan.planner.intra.ilp import min_memory, solve
from meshplan.planner.intra.extract import extract
from meshplan.planner.intra.ilp_problem import IlpSolution


@dataclass(frozen=True)
class StageLabel:
    """Which plan of a stage an option is: its logical mesh, the memory bound it was solved
    under, whether it is recomputed."""

    logical_shape: tuple[int, int]
    budget: str        # "free", "limit" (the device-memory limit) or "lean" (see `_price`)
    recompute: bool


@dataclass(frozen=True)
class StageSolution:
    """A solved stage plan, kept so the chosen stages need no second solve."""

    form: Formulation
    solution: IlpSolution
    graph: Graph


@dataclass(frozen=True)
class _Costed:
    """A priced stage plan: seconds per micro-batch without the inbound transfer (run once,
    and recomputed) and its bytes per device (state, activations, received inputs)."""

    latency: float
    recompute_latency: float
    state: float
    act: float
    inputs: float

    def __add__(self, o: "_Costed") -> "_Costed":
        return _Costed(self.latency + o.latency, self.recompute_latency + o.recompute_latency,
                       self.state + o.state, self.act + o.act, self.inputs + o.inputs)


@dataclass
class StageProfiler:
    """``profile(start, end, submesh)`` for `PipelineProblem` (module docstring).

    ``graph``: the traced program at one micro-batch's size, at the compute dtype. With
    ``exact_up_to`` layers or fewer, or when ``telescope`` is off, every range is solved as it
    is; longer ranges are priced by telescoping (`_telescoped`) and solved only when chosen.
    ``logical_shapes`` restricts the logical meshes priced (a hand-style method's own).
    """

    graph: Graph
    layering: Layering
    cluster: Cluster
    options: IntraOptions
    optimizer_bytes_per_param: float
    microbatches: int
    memory_limit: float | None = None   # bytes per device the DP checks against
    recompute: str = "auto"             # "auto": both variants; "none"/"full": one of them
    telescope: bool = True
    logical_shapes: frozenset[tuple[int, int]] | None = None  # None: every (r, c) of a submesh
    solves: int = 0

    def __post_init__(self) -> None:
        self._by_key: dict[tuple, tuple[StageOption, ...]] = {}
        self._costed: dict[tuple, _Costed | None] = {}
        self._solutions: dict[tuple, StageSolution] = {}
        self._graphs: dict[tuple[int, int], Graph] = {}
        self._keys: dict[tuple[int, int], str] = {}

    def stage(self, start: int, end: int) -> Graph:
        if (start, end) not in self._graphs:
            self._graphs[(start, end)] = stage_graph(self.graph, self.layering, start, end)
        return self._graphs[(start, end)]

    def key(self, start: int, end: int) -> str:
        if (start, end) not in self._keys:
            self._keys[(start, end)] = structure_key(self.stage(start, end))
        return self._keys[(start, end)]

    def __call__(self, start: int, end: int, submesh: Submesh) -> tuple[StageOption, ...]:
        out = []
        # What a stage receives is what its first layer does (a one-layer program is cheaper
        # to build than the whole range).
        transfer = self._transfer_time(self.stage(start, start + 1))
        for shape in factor_pairs(submesh[0] * submesh[1]):
            if self.logical_shapes is not None and shape not in self.logical_shapes:
                continue
            for budget in self._budgets(start, end):
                c = self._range(start, end, submesh, shape, budget)
                if c is not None:
                    out += self._options(c, transfer, StageLabel(shape, budget, False))
        return tuple(out)

    def _options(self, c: _Costed, transfer: float, label: StageLabel) -> list[StageOption]:
        out = []
        if self.recompute != "full":
            out.append(StageOption(c.latency + transfer, c.state, c.act + c.inputs, label))
        if self.recompute != "none":
            out.append(StageOption(c.recompute_latency + transfer, c.state + c.act, c.inputs,
                                   replace(label, recompute=True)))
        return out

    def _whole(self, start: int, end: int) -> bool:
        return not self.telescope or end - start <= 2

    def _budgets(self, start: int, end: int) -> tuple[str, ...]:
        return ("free", "limit") if self._whole(start, end) else ("free", "lean")

    def _range(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
               budget: str) -> _Costed | None:
        if self._whole(start, end):
            return self._exact(start, end, submesh, shape, budget)
        return self._telescoped(start, end, submesh, shape, budget)

    def _telescoped(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
                    budget: str) -> _Costed | None:
        """A stage of more than two layers as the sum of its layers, each priced as a one-layer
        stage: it receives its inputs in any layout and sends reduced outputs, so each boundary
        inside the stage is priced as a reduction plus a free relayout (Megatron's blocks
        exchange a replicated residual stream, which is what that costs), and what a later
        layer receives is kept as an activation. Repeated layers share one solve, so a range
        of any length costs a handful of one-layer solves; the stages the DP picks are solved
        whole afterwards."""
        total = self._exact(start, start + 1, submesh, shape, budget)
        for m in range(start + 1, end):
            layer = self._exact(m, m + 1, submesh, shape, budget)
            if total is None or layer is None:
                return None
            total = total + replace(layer, act=layer.act + layer.inputs, inputs=0.0)
        return total

    def _exact(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
               budget: str) -> _Costed | None:
        key = (self.key(start, end), submesh, shape, budget)
        if key not in self._costed:
            self._costed[key] = self._price(self.stage(start, end), key, submesh, shape, budget)
        return self._costed[key]

    def solution(self, start: int, end: int, submesh: Submesh, label: StageLabel
                 ) -> StageSolution:
        """The solved plan behind an option the DP chose, solved whole now if it was priced
        by parts (a lean one under the memory limit, else at its own leanest)."""
        g = self.stage(start, end)
        base = (self.key(start, end), submesh, label.logical_shape)
        kinds = [label.budget] if label.budget != "lean" else ["limit", "lean"]
        if label.budget == "free" or self.memory_limit is None:
            kinds = ["free"]
        for kind in kinds:
            if (*base, kind) not in self._solutions:
                self._price(g, (*base, kind), submesh, label.logical_shape, kind, force=True)
            if (*base, kind) in self._solutions:
                return self._solutions[(*base, kind)]
        raise AssertionError(f"meshplan internal error: stage [{start}, {end}) on {submesh} "
                             "has no plan although the DP chose one")

    # ------------------------------------------------------------------ one logical shape
    def _context(self, submesh: Submesh, shape: tuple[int, int]) -> CostContext:
        sub = replace(self.cluster, name=f"{self.cluster.name}[{submesh[0]}x{submesh[1]}]",
                      num_hosts=submesh[0], devices_per_host=submesh[1])
        return CostContext(logical_mesh(sub, shape), sub.device, self.optimizer_bytes_per_param,
                           microbatches=self.microbatches)

    def _price(self, g: Graph, key: tuple, submesh: Submesh, shape: tuple[int, int],
               budget: str, force: bool = False) -> _Costed | None:
        """The time-optimal plan of ``g`` under ``budget``: "free" (none), "limit" (the device
        memory limit; only sought when the free plan exceeds it, unless ``force``), "lean"
        (5 % above the smallest memory any plan of ``g`` needs)."""
        if budget == "limit":
            free = self._exact_free(g, key, submesh, shape)
            if self.memory_limit is None or (not force and (
                    free is None or free.state + free.act + free.inputs <= self.memory_limit)):
                return None
        ctx = self._context(submesh, shape)
        form = formulate(resolve_choices(g, shape, self.options), ctx,
                         None if budget == "free" else self.memory_limit or 0.0,
                         share_blocks=self.options.share_blocks)
        if budget == "lean":  # the same problem, bounded just above its smallest memory
            form = replace(form, problem=replace(
                form.problem, memory_budget=min_memory(form.problem) * 1.05))
        s = self._solve(g, form, key)
        if s is None:
            return None
        state, act, inputs = self._memory(s, split_inputs=True)
        return _Costed(self._latency(s), self._recompute_latency(s, ctx), state, act, inputs)

    def _exact_free(self, g: Graph, key: tuple, submesh: Submesh, shape: tuple[int, int]
                    ) -> _Costed | None:
        free_key = (*key[:3], "free")
        if free_key not in self._costed:
            self._costed[free_key] = self._price(g, free_key, submesh, shape, "free")
        return self._costed[free_key]

    def _solve(self, g: Graph, form: Formulation, key: tuple) -> StageSolution | None:
        self.solves += 1
        try:
            sol = solve(form.problem)
        except InfeasibleIlpError:
            return None
        self._solutions[key] = StageSolution(form, sol, g)
        return self._solutions[key]

    def _latency(self, s: StageSolution) -> float:
        tie = s.form.ctx.tie_break * sum(self._memory(s))
        return (s.solution.objective - tie) / self.microbatches

    def _recompute_latency(self, s: StageSolution, ctx: CostContext) -> float:
        """The same plan with its forward run again in backward: its compute and forward
        collectives once more (`extract` prices a fixed plan without rebuilding the ILP)."""
        again = replace(ctx, recompute=True)
        once = extract(s.form, s.solution.choices, ctx).step_time_s
        twice = extract(replace(s.form, ctx=again), s.solution.choices, again).step_time_s
        return self._latency(s) + (twice - once) / self.microbatches

    def _memory(self, s: StageSolution, split_inputs: bool = False) -> tuple[float, ...]:
        """(state, activations[, inputs]) bytes per device of a solved stage."""
        mem, roots = s.form.problem.node_memory, s.form.roots
        by = s.graph.by_name
        parts = {"param": 0.0, "act": 0.0, "in": 0.0}
        for i, r in enumerate(roots):
            role = by[r].role
            part = "param" if role == "param" else "in" if role in ("input", "target") \
                else "act"
            parts[part] += mem[i][s.solution.choices[i]]
        if split_inputs:
            return parts["param"], parts["act"], parts["in"]
        return parts["param"], parts["act"] + parts["in"]

    def _transfer_time(self, g: Graph) -> float:
        """Receiving the stage's activations and sending their gradients back, per micro-batch,
        over the slowest link between stages (another host's when the cluster has several)."""
        received = [n for n in g.nodes if n.role == "input" and n.op == "input"
                    and not n.state_name]
        nbytes = sum(n.out.nbytes * (2 if n.requires_grad else 1) for n in received)
        if not nbytes:
            return 0.0
        link = self.cluster.inter_host if self.cluster.num_hosts > 1 else self.cluster.intra_host
        return link.latency + nbytes / link.bandwidth
