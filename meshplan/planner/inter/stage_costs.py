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
once per (structure, submesh, logical shape): Alpa's reuse of identical layer ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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
from meshplan.planner.intra.ilp import solve
from meshplan.planner.intra.extract import extract
from meshplan.planner.intra.ilp_problem import IlpSolution


@dataclass(frozen=True)
class StageLabel:
    """Which plan of a stage an option is: its logical mesh, whether it was solved under the
    device-memory budget, whether it is recomputed."""

    logical_shape: tuple[int, int]
    budgeted: bool
    recompute: bool


@dataclass(frozen=True)
class StageSolution:
    """A solved stage plan, kept so the chosen stages need no second solve."""

    form: Formulation
    solution: IlpSolution
    graph: Graph


@dataclass
class StageProfiler:
    """``profile(start, end, submesh)`` for `PipelineProblem` (module docstring).

    ``graph``: the traced program at one micro-batch's size, at the compute dtype.
    """

    graph: Graph
    layering: Layering
    cluster: Cluster
    options: IntraOptions
    optimizer_bytes_per_param: float
    microbatches: int
    memory_limit: float | None = None   # bytes per device the DP checks against
    recompute: str = "auto"             # "auto": both variants; "none"/"full": one of them
    solves: int = 0

    def __post_init__(self) -> None:
        self._by_key: dict[tuple, tuple[StageOption, ...]] = {}
        self._solutions: dict[tuple, StageSolution] = {}
        self._graphs: dict[tuple[int, int], Graph] = {}

    def stage(self, start: int, end: int) -> Graph:
        if (start, end) not in self._graphs:
            self._graphs[(start, end)] = stage_graph(self.graph, self.layering, start, end)
        return self._graphs[(start, end)]

    def __call__(self, start: int, end: int, submesh: Submesh) -> tuple[StageOption, ...]:
        g = self.stage(start, end)
        key = (structure_key(g), submesh)
        if key not in self._by_key:
            self._by_key[key] = tuple(o for shape in factor_pairs(submesh[0] * submesh[1])
                                      for o in self._shape_options(g, key, submesh, shape))
        return self._by_key[key]

    def solution(self, start: int, end: int, submesh: Submesh, label: StageLabel
                 ) -> StageSolution:
        """The solved plan behind an option the DP chose."""
        g = self.stage(start, end)
        return self._solutions[(structure_key(g), submesh, label.logical_shape, label.budgeted)]

    # ------------------------------------------------------------------ one logical shape
    def _shape_options(self, g: Graph, key: tuple, submesh: Submesh,
                       shape: tuple[int, int]) -> list[StageOption]:
        sub = replace(self.cluster, name=f"{self.cluster.name}[{submesh[0]}x{submesh[1]}]",
                      num_hosts=submesh[0], devices_per_host=submesh[1])
        ctx = CostContext(logical_mesh(sub, shape), sub.device, self.optimizer_bytes_per_param,
                          microbatches=self.microbatches)
        choices = resolve_choices(g, shape, self.options)
        out = []
        free = self._solve(g, choices, ctx, None, (*key, shape, False))
        limit = self.memory_limit
        plans = [free] if free is not None else []
        if free is not None and limit is not None and sum(self._memory(free)) > limit:
            lean = self._solve(g, choices, ctx, limit, (*key, shape, True))
            plans += [lean] if lean is not None else []
        transfer = self._transfer_time(g)
        for budgeted, s in zip((False, True), plans):
            state, act, inputs = self._memory(s, split_inputs=True)
            latency = self._latency(s) + transfer
            if self.recompute != "full":
                out.append(StageOption(latency, state, act + inputs,
                                       StageLabel(shape, budgeted, False)))
            if self.recompute != "none":
                again = self._recompute_latency(s, ctx) + transfer
                out.append(StageOption(again, state + act, inputs,
                                       StageLabel(shape, budgeted, True)))
        return out

    def _solve(self, g: Graph, choices: Any, ctx: CostContext, budget: float | None,
               key: tuple) -> StageSolution | None:
        form = formulate(choices, ctx, budget, share_blocks=self.options.share_blocks)
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
