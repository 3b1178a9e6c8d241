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

Each shape gives the time-optimal plan ("free"), the fastest within 5 % of the smallest memory
any plan of the stage needs ("lean": ZeRO, tensor parallelism), the same with as many
micro-batches kept as an early stage keeps ("deep") and, with a tensor axis inside a host,
Megatron's plan ("tp"; see `StageProfiler.variants`). Each plan also comes recomputed,
layer by layer as Megatron-LM's full recomputation: per micro-batch only what each layer
receives is kept, one layer's activations at a time in backward, and the forward runs twice.
The DP uses these where memory demands it, so the plans other than "free" are priced only on
the submeshes and logical shapes where the memory limit may bind (`memory_may_bind`). A lazy
profiler (the stage search's) goes further: "lean" and "deep", two solves each, wait until a
pipeline the DP finds uses them; until then the DP weighs a lower bound of each in every figure
it reads, made of the "free" plan and one device's bytes (`_placeholder`), and the search
prices what its pipelines use and runs the DP again (`search._settled`, `reveal`).

Costs are cached by the stage's structure (`structure_key`), so repeated blocks are solved once
per (structure, submesh, logical shape): Alpa's reuse of identical layer ranges. Ranges of more
than ``exact_up_to`` layers are priced as sums of one-layer solves (`_slot_columns`), so the solves
grow with the distinct layers, not with L². An end layer holding a repeated layer and more
(the embedding with the first block) is priced by its parts, the one equal to the repeated layer
sharing its solves, where that prices it as its whole solve does (`layer_parts.py`,
`StageProfiler._by_parts`). The stages the DP picks are then solved whole
(`solution`) with memory counted as the pipeline holds it, in-flight micro-batches included
and, for a plain stage, the op-by-op transients the simulator holds beyond the ILP's live sets
(`transient_bytes`), and their real latency and peak memory replace the estimates.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Iterable, Iterator, Mapping

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.devices import DeviceType
from meshplan.cost.memory import OptimizerState
from meshplan.cost.mesh import factor_pairs, logical_mesh
from meshplan.errors import IlpCutOffError, InfeasibleIlpError
from meshplan.ir.graph import Graph
from meshplan.planner.inter import price_sharing
from meshplan.planner.inter.clustering import Layering
from meshplan.planner.inter.layer_parts import LayerParts, split_layers
from meshplan.planner.inter.stage_graph import stage_graph, structure_key
from meshplan.planner.inter.stage_problem import (ClusterShape, OptionTable, StageOption,
                                                  StagePlacement, Submesh, most_in_flight,
                                                  submesh_shapes, triple_index)
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import (CostContext, Formulation, formulate, renamed,
                                              without_zero3)
from meshplan.planner.intra.ilp import PLAN_REL_GAP, min_memory, plan_solve, solve
from meshplan.planner.intra.extract import node_indices, recompute_extra_s, step_peaks_of
from meshplan.planner.intra.op_costs import OpCosts
from meshplan.planner.recompute import FULL, SELECTIVE, Replay, attention_cores
from meshplan.planner.intra.ilp_problem import (IlpProblem, IlpSolution, peak_memory,
                                                working_peak)
from meshplan.progress import progress


@dataclass(frozen=True)
class StageLabel:
    """Which plan of a stage an option is: its logical mesh, the memory bound it was solved
    under, whether it is recomputed and how (``kind``, `replay_of`): "plain", "full" (every
    layer), "half" (its first half of layers), "layers:K" (its first K) or "selective" (its
    attention cores)."""

    logical_shape: tuple[int, int]
    budget: str        # "free", "lean", "deep" or "tp" (see `StageProfiler.variants`)
    recompute: bool
    kind: str = ""     # "": "full" when recomputed, else "plain"

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", "full" if self.recompute else "plain")
        if self.recompute != (self.kind != "plain"):
            raise ValueError(f"a stage label recomputed={self.recompute} of kind {self.kind!r}")


@functools.lru_cache(maxsize=None)
def _label(shape: tuple[int, int], budget: str, kind: str) -> StageLabel:
    # One object per kind: profiles make many.
    return StageLabel(shape, budget, kind != "plain", kind)


def replay_of(kind: str, num_layers: int) -> Replay | None:
    """What a stage of ``num_layers`` layers replays under the recomputation ``kind`` of its
    label (None: nothing)."""
    if kind == "plain":
        return None
    if kind == "selective":
        return SELECTIVE
    first = -(-num_layers // 2) if kind == "half" else \
        int(kind.partition(":")[2]) if kind.startswith("layers:") else num_layers
    return FULL if first >= num_layers else Replay("layers", first)


def recompute_kinds(recompute: str, has_cores: bool) -> tuple[str, ...]:
    """The recomputation kinds a stage is priced with under the user's ``recompute``
    (`planner/recompute.parse_recompute`): "auto" weighs none, the attention cores (where the
    program has them), the first half of the stage's layers and all of them."""
    if recompute == "auto":
        return ("plain", *(("selective",) if has_cores else ()), "half", "full")
    return {"none": ("plain",), "full": ("full",)}.get(recompute, (recompute,))


@dataclass(frozen=True)
class StageSolution:
    """A solved stage plan: the formulation, the ILP's answer, the stage's program, and as the
    pipeline runs it (``in_flight`` micro-batches kept) its seconds per micro-batch and peak
    bytes per device."""

    form: Formulation
    solution: IlpSolution
    graph: Graph
    latency: float = 0.0
    memory_bytes: float = 0.0


@dataclass(frozen=True)
class _Costed:
    """A priced one-layer (or exact) stage plan: seconds per micro-batch without the inbound
    transfer (run once, and recomputed) and its bytes per device (state, activations, received
    inputs)."""

    latency: float
    recompute_latency: float
    state: float
    act: float
    inputs: float
    # Its attention cores replayed (`planner/recompute.py`): seconds per micro-batch, the
    # activations kept, the largest core's (held while it replays), how many cores; and
    # whether the plan keeps parameters under ZeRO-3 (no partial replay with it yet).
    selective_latency: float = 0.0
    selective_act: float = 0.0
    selective_work: float = 0.0
    cores: int = 0
    zero3: bool = False


def _summed(parts: list[_Costed]) -> _Costed:
    """A layer priced as its parts in order, as a range of layers is (`_slot_columns`): what
    a later part receives from an earlier one is kept with the layer's activations, and the
    layer's inputs are what its first part receives (all a recomputed layer keeps)."""
    inner = sum(c.inputs for c in parts[1:])
    return _Costed(sum(c.latency for c in parts), sum(c.recompute_latency for c in parts),
                   sum(c.state for c in parts), sum(c.act for c in parts) + inner,
                   parts[0].inputs, sum(c.selective_latency for c in parts),
                   sum(c.selective_act for c in parts) + inner,
                   max(c.selective_work for c in parts), sum(c.cores for c in parts),
                   any(c.zero3 for c in parts))


def shared_params(graph: Graph, layering: Layering) -> frozenset[str]:
    """The parameters (node names) that ops of more than one layer of ``layering`` use."""
    layer_of = {name: j for j, names in enumerate(layering.layers) for name in names}
    params = {n.name for n in graph.nodes if n.role == "param"}
    users: dict[str, set[int]] = {}
    for n in graph.nodes:
        if n.role == "op" and n.name in layer_of:
            for i in n.inputs:
                if i in params:
                    users.setdefault(i, set()).add(layer_of[n.name])
    return frozenset(p for p, layers in users.items() if len(layers) > 1)


@dataclass
class StageProfiler:
    """``profile(start, end, submesh)`` for `PipelineProblem` (module docstring).

    ``graph``: the traced program at one micro-batch's size, at the compute dtype. Ranges of
    ``exact_up_to`` layers or fewer are solved as they are; longer ranges are priced by
    telescoping (`_slot_columns`) and solved whole only when chosen (`solution`).
    ``logical_shapes`` restricts the logical meshes priced (a hand-style method's own).
    """

    graph: Graph
    layering: Layering
    cluster: Cluster
    options: IntraOptions
    optimizer_state: OptimizerState
    microbatches: int
    memory_limit: float | None = None   # bytes per device the DP checks against
    recompute: str = "auto"             # the user's: "auto" weighs `recompute_kinds`
    exact_up_to: int = 1
    show_progress: bool = False         # a bar on stderr while pricing (`meshplan.progress`)
    tensor_within_host: bool = False    # multi-host submeshes: only (r, c) with c | M
    logical_shapes: frozenset[tuple[int, int]] | None = None  # None: every (r, c) of a submesh
    # A mixed cluster's device kinds: a typed submesh (hosts, devices, k) is priced on
    # ``kinds[k]``, k == len(kinds) (mixed) and an untyped one on the cluster's slowest.
    kinds: tuple[DeviceType, ...] = ()
    solves: int = 0
    # Price an end layer holding a repeated layer as its parts (`layer_parts.py`).
    in_parts: bool = True
    # The schedule the pipelines weighed run, "gpipe" or "1f1b" (interleaving included): how
    # many micro-batches `memory_may_bind` holds in flight (`most_in_flight`).
    schedule: str = "gpipe"
    # Price the memory-trading variants only where a pipeline that may win uses them
    # (`estimates`, `reveal`); every other caller sees them priced.
    lazy: bool = False

    def __post_init__(self) -> None:
        # A parameter used by several layers may be held by several stages, which sum its
        # gradient whole (`lower/stage_transfers.py`): no ZeRO for it.
        shared = shared_params(self.graph, self.layering)
        if shared - self.options.replicated_updates:
            self.options = replace(self.options,
                                   replicated_updates=self.options.replicated_updates | shared)
        self._costed: dict[tuple, _Costed | None] = {}
        self._forms: dict[tuple, Formulation] = {}
        self._graphs: dict[tuple[int, int], Graph] = {}
        self._keys: dict[tuple[int, int], str] = {}
        self._sums: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._transfers: dict[int, float] = {}
        self._boundaries: dict[int, float] = {}   # `_boundary_bytes`
        self._wholes: dict[tuple, IlpSolution] = {}   # chosen stages solved whole
        self._whole_costs: dict[tuple, tuple[float, float]] = {}   # `whole_cost`
        # Whole solves cut off (`whole_cost_below`): seconds per micro-batch, without the
        # inbound transfer, that the stage so solved would not be under.
        self._whole_floors: dict[tuple, float] = {}
        self._form_ranges: dict[tuple, tuple[int, int]] = {}   # `_form`'s first range
        self._shapes: dict[Submesh, list[tuple[int, int]]] = {}   # asked once per DP call
        self._free: dict[tuple, StageSolution | None] = {}   # "free" one-layer solves
        # Their plans, kept where a forked task made them (`prefetch`): a deferred variant
        # priced later in another task starts from the same plan (`_price`).
        self._free_plans: dict[tuple, IlpSolution] = {}
        self._extras: dict[tuple, tuple] = {}   # `_recompute_latency` by (formulation, plan)
        self._replay_kinds = recompute_kinds(self.recompute, bool(attention_cores(self.graph)))
        self._parts: tuple[LayerParts, StageProfiler] | None = None
        self._gates: dict[int, bool] = {}   # `_by_parts`
        self._needs: dict[tuple, float] = {}   # `memory_may_bind`
        # (submesh, logical shape, variant) of `LAZY_VARIANTS` priced for every layer.
        self._revealed: set[tuple] = set()
        self._dp_limit = math.inf if self.memory_limit is None else self.memory_limit
        self._offered = False   # to the later profilers of a `price_sharing` scope
        # The kinds priced as the cluster's slowest device (`priced_as`).
        self._as_slowest = frozenset(k for k, t in enumerate(self.kinds)
                                     if t.figures == self.cluster.device.figures)
        if self.in_parts and self.layering.num_layers > 2:
            self._parts = self._part_pricer()

    def _part_pricer(self) -> tuple[LayerParts, "StageProfiler"] | None:
        """The layering's parts (`layer_parts.py`) and the profiler that prices one-layer
        ranges by them, or None when no layer splits."""
        n = self.layering.num_layers
        parts = split_layers(self.graph, self.layering, [self.key(m, m + 1) for m in range(n)],
                             lambda m: self.stage(m, m + 1))
        if parts is None:
            return None
        pricer = replace(self, layering=parts.parts, in_parts=False, solves=0, lazy=False)
        pricer._graphs.update(parts.programs)
        return parts, pricer

    def priced_as(self, submesh: Submesh) -> Submesh:
        """The submesh whose prices ``submesh``'s are: a typed one of a kind with the figures
        of the cluster's slowest device (`DeviceType.figures`: HAP's P100 hosts against "the
        slowest of V100+P100") is the untyped one, priced once for both. Every method taking
        a submesh asks this first; `stage_cluster` keeps the kind (a plan names its device)."""
        return submesh[:2] if len(submesh) > 2 and submesh[2] in self._as_slowest else submesh

    def _priced_stages(self, stages: list[tuple]) -> list[tuple]:
        """``(start, end, submesh, ...)`` each, its submesh `priced_as`."""
        return [(a, b, self.priced_as(sub), *rest) for a, b, sub, *rest in stages]

    def stage(self, start: int, end: int) -> Graph:
        if (start, end) not in self._graphs:
            self._graphs[(start, end)] = stage_graph(self.graph, self.layering, start, end)
        return self._graphs[(start, end)]

    def key(self, start: int, end: int) -> str:
        if (start, end) not in self._keys:
            self._keys[(start, end)] = structure_key(self.stage(start, end))
        return self._keys[(start, end)]

    def shapes(self, submesh: Submesh) -> list[tuple[int, int]]:
        """The logical meshes of ``submesh`` priced: every one (or those of
        ``logical_shapes``) but those whose two axes both cross hosts, less mirror images.
        (r, c) and (c, r) whose axes have the same links, or (1, n) and (n, 1), are one
        problem with its axes swapped when no option singles out an axis, so only the first
        is solved.

        Of a submesh of several hosts, a mesh whose fast axis does not divide a host and
        whose other axis is not one (on 3 x 8: (2, 12), (4, 6), (8, 3)) is not priced: both
        its axes cross hosts. Alpa's stage search leaves out those whose fast axis is wider
        than a host ((2, 12)); without any of them the reduced rows of the weak-scaling suite
        planned the same 77 plans in 11 % less search, and GPT-39B on 64 V100 took 18.3 s
        instead of 21.7. One axis over the whole submesh stays, (1, n): a ring over every
        device shares no link (`cost/mesh.py`), and inter-only's GPT rows choose it.
        Host-granular searches (``tensor_within_host``) price the same shapes, the ring as
        (n, 1)."""
        if submesh not in self._shapes:
            self._shapes[submesh] = self._list_shapes(submesh)
        return self._shapes[submesh]

    def _list_shapes(self, submesh: Submesh) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for s in factor_pairs(submesh[0] * submesh[1]):
            if self.logical_shapes is not None and s not in self.logical_shapes:
                continue
            per_host = self.cluster.devices_per_host
            if submesh[0] > 1 and per_host % s[1] and (
                    self.tensor_within_host or (s[0] > 1 and self.logical_shapes is None)):
                continue   # both axes across hosts (a method's own shapes are its choice)
            if (s[1], s[0]) in out and self._symmetric(submesh, s):
                continue
            out.append(s)
        return out

    def _symmetric(self, submesh: Submesh, shape: tuple[int, int]) -> bool:
        o = self.options
        if o.force_batch_axis is not None or o.tensor_axis is not None:
            return False
        if 1 in shape:   # an axis of one device moves nothing, whatever its links
            return True
        mesh = self._context(submesh, shape).mesh
        return mesh.alpha[0] == mesh.alpha[1] and mesh.beta[0] == mesh.beta[1]

    def variants(self, submesh: Submesh, shape: tuple[int, int]) -> tuple[str, ...]:
        """The plans priced per logical shape: "free" (time-optimal), and under a memory limit
        that may bind there (`memory_may_bind`) "lean" (within 5 % of the smallest memory),
        "deep" (the same for a stage that keeps several micro-batches, `deep_in_flight`) and,
        where the shape has a tensor axis inside a host, "tp" (Megatron-style: batch on axis
        0, tensors on axis 1, time-optimal). Long stages are priced by parts, so the plans
        between the fastest and the leanest are only those the parts offer: "tp" is the one a
        Megatron user would pick, whose memory usually lies between, so every hand-tuned 3-D
        configuration is in the DP's space too."""
        if not self.memory_may_bind(submesh, shape):
            return ("free",)
        o, per_host = self.options, min(submesh[1], self.cluster.devices_per_host)
        # On a few hosts, only within one: a multi-host stage's own plans are data parallel
        # across hosts already, and pricing it costs the most logical shapes.
        tp = shape[1] > 1 and per_host % shape[1] == 0 and o.force_batch_axis is None \
            and o.tensor_axis is None and not o.force_data_parallel \
            and (submesh[0] == 1 or self.tensor_within_host)
        deep = ("deep",) if self.deep_in_flight(submesh) > 1 else ()
        return ("free", "lean", *deep, "tp") if tp else ("free", "lean", *deep)

    def memory_may_bind(self, submesh: Submesh, shape: tuple[int, int]) -> bool:
        """Whether the memory limit the DP checks (`bind_below` lowers it) may bind a stage
        on ``submesh`` laid out as ``shape``: whether the fastest plans ("free") of all the
        layers, held as one stage with the most micro-batches any stage keeps in flight
        (`stage_problem.most_in_flight` on ``schedule``), exceed it (or a layer has none).
        Where they do not, every range's fastest plan fits however the pipeline runs it, and
        nothing is faster, so the DP would never pick a plan that trades speed for memory:
        those variants are not priced there. Most of a small model's pricing (a 2-layer GPT of
        2.6B's widths on 8 V100: 27 of 198 solves, 4.2 of 7.5 s in HiGHS). Decided for the
        whole program, here only: the part pricer's variants are asked for by its layers'
        tasks (`_price_all`), never listed."""
        if self.memory_limit is None:
            return False
        key = (submesh, shape)
        if key not in self._needs:
            sums, missing = self._layer_sums(submesh, shape, "free")[:2]
            layers = np.maximum(np.diff(sums[:, 2:4], axis=0), 0.0).sum(axis=0)
            held = most_in_flight(self.schedule, self.layering.num_layers,
                                  self.cluster.num_devices, self.microbatches)
            self._needs[key] = math.inf if missing[-1] else float(layers[0] + layers[1] * held)
        return self._needs[key] > self._dp_limit

    def bind_below(self, budget: float) -> None:
        """The DP will check stages against ``budget`` (< `memory_limit`: a pipeline refitted
        under what its stages solved whole hold as run): the memory-trading variants are
        priced again where it may bind (`memory_may_bind`)."""
        self._dp_limit = min(self._dp_limit, budget)

    def deep_in_flight(self, submesh: Submesh) -> int:
        """The micro-batches the "deep" variant's memory keeps: those the first of equal
        stages on ``submesh`` keeps under 1F1B (one stage per submesh of the cluster, at
        most the step's count). "lean" counts one, which suits the last stages only: where a
        stage keeps several, the plan that holds fewer activations for more state (ZeRO-2
        against ZeRO-3's gathered weights) is the leaner one, and only this variant lists
        it. GPT-6.7B on 16 V100s: a 4-layer stage on 2 devices keeping 7 micro-batches found
        no plain plan within 16 GiB by "lean" (16.72 GiB), data parallelism's fit (15.91)."""
        n = submesh[0] * submesh[1]
        return min(self.microbatches, max(self.cluster.num_devices // n, 1))

    def __call__(self, start: int, end: int, submesh: Submesh) -> tuple[StageOption, ...]:
        """Every option of ``[start, end)`` on ``submesh``, each priced (a lazy profiler prices
        what it deferred on the submesh first)."""
        if self.lazy:
            self.reveal(self.deferred_on(submesh))
        return self.estimates(start, end, submesh)

    def estimates(self, start: int, end: int, submesh: Submesh) -> tuple[StageOption, ...]:
        """The options of ``[start, end)`` on ``submesh`` as the DP weighs them: under
        ``lazy``, a memory-trading variant not priced yet is its lower bound (`_placeholder`),
        its label saying which it stands for (`deferred_in`)."""
        submesh = self.priced_as(submesh)
        out = []
        # What a stage receives is what its first layer does (a one-layer program is cheaper
        # to build than the whole range).
        transfer = self.transfer_time(start)
        for shape in self.shapes(submesh):
            for budget in self.variants(submesh, shape):
                out += self._slot(start, end, submesh, shape, budget, transfer)
            for budget, fast, lean, q in self._mixes(submesh, shape):
                ok, (lat, state, kept) = self._mix_columns(
                    np.array([start]), np.array([end]), submesh, shape, fast, lean, q,
                    np.array([transfer]))
                if ok[0]:
                    out.append(StageOption(float(lat[0]), float(state[0]), float(kept[0]),
                                           _label(shape, budget, "plain")))
        return tuple(out)

    def _mixes(self, submesh: Submesh, shape: tuple[int, int]
               ) -> list[tuple[str, str, str, int]]:
        """The mixed plans of a range, listed after its variants: ``(budget, fast, lean, q)``,
        the range's first ``q`` quarters of layers on the "free" plan and the rest on a lean
        variant ("lean" or "deep"), plain. A stage solved whole mixes plans layer by layer
        under its memory bound; by parts, a range on one variant is either the fastest plan
        or a lean one, so a stage that fits only between them looked slower than it solves
        and the DP passed over pipelines of such stages (GPT-6.7B on 16 V100s: eight stages
        of 2 devices, 42.0 s by parts with data parallelism's own lean plan, which auto's
        variants did not offer, against auto's pick at 43.2; solved whole 38.7 and 39.4)."""
        variants = self.variants(submesh, shape)
        if "free" not in variants or "plain" not in self._kinds():
            return []
        return [(f"free+{lean}:{q}/4", "free", lean, q)
                for lean in ("lean", "deep") if lean in variants for q in (1, 2, 3)]

    def _mix_columns(self, k: np.ndarray, i: np.ndarray, submesh: Submesh,
                     shape: tuple[int, int], fast: str, lean: str, q: int,
                     transfer: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Ranges ``[k, i)`` of the mixed plan ``q`` (`_mixes`) priced at once as
        `_slot_columns` prices one plan: whether it applies (a range of more than
        ``exact_up_to`` layers, each part priced, its split unlike the previous quarter's)
        and its (latency, state, kept per micro-batch) columns."""
        head_sums, head_missing = self._layer_sums(submesh, shape, fast)[:2]
        tail_sums, tail_missing = self._layer_sums(submesh, shape, lean)[:2]
        count = i - k
        mid = k + count * q // 4
        ok = (count > self.exact_up_to) & (mid > k) & (mid < i) \
            & (mid != k + count * (q - 1) // 4) \
            & (head_missing[mid] == head_missing[k]) & (tail_missing[i] == tail_missing[mid])
        part = head_sums[mid] - head_sums[k] + tail_sums[i] - tail_sums[mid]
        # Differences of prefix sums may round a zero to a tiny negative.
        return ok, [np.maximum(part[:, 0] + transfer, 0.0), np.maximum(part[:, 2], 0.0),
                    np.maximum(part[:, 3], 0.0)]

    def _kinds(self) -> tuple[str, ...]:
        """The recomputation kinds of the options listed per plan, in order."""
        return self._replay_kinds

    def _slot(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
              budget: str, transfer: float) -> list[StageOption]:
        """The options of one plan (logical shape and variant) of a stage, one per kind of
        `_kinds` that applies, or none when the plan does not exist."""
        if end - start <= self.exact_up_to and self._exact(start, end, submesh, shape,
                                                           budget) is None:
            return []
        valid, columns = self._slot_columns(np.array([start]), np.array([end]), submesh,
                                            shape, budget, np.array([transfer]))
        if end - start <= self.exact_up_to:   # solved as it is: its own plain figures
            c = self._exact(start, end, submesh, shape, budget)
            assert c is not None
            plain = self._kinds().index("plain") if "plain" in self._kinds() else None
            if plain is not None:
                valid[plain][0] = True
                columns[plain] = [np.array([max(c.latency + transfer, 0.0)]), np.array([c.state]),
                                  np.array([c.act + c.inputs])]
        return [StageOption(float(lat[0]), float(state[0]), float(kept[0]),
                            _label(shape, budget, kind))
                for kind, ok, (lat, state, kept) in zip(self._kinds(), valid, columns)
                if ok[0]]

    def option_table(self, submeshes: tuple[Submesh, ...]) -> OptionTable:
        """Every range's options on every one of ``submeshes`` as columns, exactly as
        ``self(start, end, submeshes[m])`` lists them (`PipelineProblem.table`): the DP asks
        for all L(L+1)/2 ranges, which one by one cost more than the pricing they sum.
        Telescoped ranges come from vectorized prefix-sum differences (the same float
        operations as `_slot`); ranges solved as they are (one layer) from `_slot`."""
        submeshes = tuple(self.priced_as(sub) for sub in submeshes)
        n = self.layering.num_layers
        k, i = np.triu_indices(n + 1, 1)   # every range [k, i), 0 <= k < i <= n
        keep = k < n
        k, i = k[keep], i[keep]
        transfer = np.array([self.transfer_time(s) for s in range(n)])[k]
        kinds = self._kinds()
        plain = kinds.index("plain") if "plain" in kinds else None
        cols: list[list[np.ndarray]] = [[], [], [], [], []]
        for m, sub in enumerate(submeshes):
            special = np.flatnonzero(i - k <= self.exact_up_to)
            listed = np.zeros(k.size, dtype=np.int64)   # options so far per range
            triple = triple_index(k, i, m, n, len(submeshes))
            for shape in self.shapes(sub):
                for budget in self.variants(sub, shape):
                    valid, columns = self._slot_columns(k, i, sub, shape, budget, transfer)
                    # Ranges solved as they are: what `_slot` lists of them.
                    for j in special.tolist():
                        c = self._exact(int(k[j]), int(i[j]), sub, shape, budget)
                        if c is None:
                            for ok in valid:
                                ok[j] = False
                        elif plain is not None:
                            valid[plain][j] = True
                            lat, state, kept = columns[plain]
                            lat[j], state[j], kept[j] = \
                                max(c.latency + transfer[j], 0.0), c.state, c.act + c.inputs
                    for q, kind_columns in enumerate(columns):
                        rows = np.flatnonzero(valid[q])
                        for c, values in zip(cols, kind_columns):
                            c.append(values[rows])
                        cols[3].append(triple[rows])
                        cols[4].append(listed[rows])
                        listed[rows] += 1
                for _, fast, lean, q in self._mixes(sub, shape):
                    ok, mix_columns = self._mix_columns(k, i, sub, shape, fast, lean, q,
                                                        transfer)
                    rows = np.flatnonzero(ok)
                    for c, values in zip(cols, mix_columns):
                        c.append(values[rows])
                    cols[3].append(triple[rows])
                    cols[4].append(listed[rows])
                    listed[rows] += 1
        cat = [np.concatenate(c) if c else np.zeros(0) for c in cols]
        return OptionTable(cat[0].astype(np.float64), cat[1].astype(np.float64),
                           cat[2].astype(np.float64), cat[3].astype(np.int64),
                           cat[4].astype(np.int64))

    def _slot_columns(self, k: np.ndarray, i: np.ndarray, submesh: Submesh,
                      shape: tuple[int, int], budget: str, transfer: np.ndarray
                      ) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        """Every range ``[k, i)`` of one plan priced at once (telescoped), plus ``transfer``:
        per kind of `_kinds`, whether it applies to the range and its (latency, state, kept
        per micro-batch) columns.

        A stage of several layers is the sum of its layers, each priced as a one-layer stage:
        it receives its inputs in any layout and sends reduced outputs, so each boundary inside
        the stage is priced as a reduction plus a free relayout (Megatron's blocks exchange a
        replicated residual stream, which is what that costs). Without recomputation, what
        each layer receives is kept per micro-batch with its activations; a recomputed layer
        (Megatron-LM's full recomputation: a range's first layers, its "block" method) keeps
        only what it receives, and the backward holds the largest replayed layer's
        activations once; with its attention cores replayed a layer keeps all but the cores'
        own values and holds the largest core's once. Repeated layers share one solve, and
        prefix sums price any range in constant time; the stages the DP picks are then solved
        whole."""
        sums, missing, act_max, sel_max = self._layer_sums(submesh, shape, budget)
        exists = missing[i] == missing[k]
        d = sums[i] - sums[k]
        state = np.maximum(d[:, 2], 0.0)
        valid, columns = [], []
        for kind in self._kinds():
            ok = exists.copy()
            if kind == "plain":
                cols = [d[:, 0] + transfer, state, np.maximum(d[:, 3], 0.0)]
            elif kind == "selective":
                ok &= (d[:, 7] > 0.5) & (d[:, 8] < 0.5)
                cols = [d[:, 5] + transfer, state + sel_max[k, i - 1],
                        np.maximum(d[:, 6], 0.0)]
            else:
                count = i - k
                first = np.minimum(count, -(-count // 2) if kind == "half" else
                                   int(kind.partition(":")[2]) if kind.startswith("layers:")
                                   else count)
                mid = k + first
                head, tail = sums[mid] - sums[k], sums[i] - sums[mid]
                # A partial replay with ZeRO-3 is not supported yet; "half" of one layer is
                # the full replay, listed already.
                ok &= (first == count) | (d[:, 8] < 0.5)
                if kind == "half":
                    ok &= first < count
                cols = [head[:, 1] + tail[:, 0] + transfer, state + act_max[k, mid - 1],
                        np.maximum(head[:, 4] + tail[:, 3], 0.0)]
            valid.append(ok)
            # Differences of prefix sums may round a zero to a tiny negative.
            columns.append([np.maximum(cols[0], 0.0), *cols[1:]])
        return valid, columns

    def _layer_sums(self, submesh: Submesh, shape: tuple[int, int], budget: str
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per layer of ``submesh``/``shape``/``budget``: prefix sums over layers of (latency,
        recomputed latency, state, activations + inputs, inputs, latency with its attention
        cores replayed, activations + inputs so, cores, ZeRO-3) (``sums[m]``: the layers
        before m), of the layers without a plan (``missing``), and ``act_max[i, j]`` /
        ``sel_max[i, j]`` the largest activations / attention core of layers i..j."""
        key = (submesh, shape, budget)
        if key not in self._sums:
            n = self.layering.num_layers
            rows, bad = np.zeros((n, 9)), np.zeros(n, dtype=np.int64)
            work = np.zeros(n)
            for m in range(n):
                c = self._exact(m, m + 1, submesh, shape, budget)
                if c is None:
                    bad[m] = 1
                else:
                    rows[m] = (c.latency, c.recompute_latency, c.state, c.act + c.inputs,
                               c.inputs, c.selective_latency, c.selective_act + c.inputs,
                               c.cores, c.zero3)
                    work[m] = c.selective_work
            act_max, sel_max = np.zeros((n, n)), np.zeros((n, n))
            for m in range(n):
                act_max[m, m:] = np.maximum.accumulate(rows[m:, 3] - rows[m:, 4])
                sel_max[m, m:] = np.maximum.accumulate(work[m:])
            self._sums[key] = (np.vstack([np.zeros((1, 9)), np.cumsum(rows, axis=0)]),
                               np.concatenate([[0], np.cumsum(bad)]), act_max, sel_max)
        return self._sums[key]

    def prefetch(self, submeshes: tuple[Submesh, ...], workers: int | None = None) -> None:
        """Price every distinct one-layer structure on every submesh and logical shape ahead of
        the DP, which asks for all of them anyway. The solves are independent, so with many of
        them they run on ``workers`` forked processes (default: the usable cores; fork shares
        the program without pickling it); results are identical to pricing on demand. Layers
        with parts are priced by them (`_by_parts`, checked first, so that a part only its
        layer needs is not priced where the layer is whole)."""
        submeshes = tuple(dict.fromkeys(self.priced_as(sub) for sub in submeshes))
        if not self._offered:   # before anything is priced or summed
            for base in price_sharing.priced_before():
                self.adopt(base)
            price_sharing.offer(self)
            self._offered = True
        layers = self._distinct_layers()
        for m in layers:
            self._by_parts(m)
        # A task per submesh and logical shape, all layers: their fastest plans say whether
        # memory may bind there (`memory_may_bind`), and the other variants are priced after
        # them, on the formulations and plans those made, only where it may (deferred under
        # ``lazy``: `reveal`).
        tasks = [(layers, sub, shape) for sub in submeshes for shape in self.shapes(sub)
                 if any((self.key(m, m + 1), sub, shape, "free") not in self._costed
                        for m in layers)]
        # Each task is a pricing per layer: forked from as many one-layer pricings as before.
        priced = progress(self._map("_price_all", tasks, workers,
                                    -(-PARALLEL_FROM_TASKS // max(len(layers), 1))),
                          total=len(tasks), desc=f"stage costs, {self.microbatches} micro-batches",
                          enabled=self.show_progress)
        for costs, solves, plans in priced:
            self.solves += solves
            self._costed.update(costs)
            for pricer, made in zip(self._pricers(), plans):
                pricer._free_plans.update(made)

    def adopt(self, base: "StageProfiler") -> int:
        """Take ``base``'s one-layer prices (every variant priced, the fastest plans lean
        variants start from, which layers are priced by parts) and, under the same memory
        limit, its stages solved whole (and the bounds its cut-off solves proved), wherever
        they were made on this profiler's cost context: the same program at the same
        micro-batch count, layers and options, and per submesh and logical shape the same
        `CostContext` (device type, links, logical mesh) and in-flight micro-batches of
        "deep". There a price is what this profiler would solve for (the solves are
        deterministic), so the plan is the one made without sharing
        (`tests/test_price_sharing.py`). Call before pricing anything; returns the prices
        taken."""
        if not self._prices_like(base):
            return 0
        taken = 0
        wholes = ("_wholes", "_whole_costs", "_whole_floors") \
            if base.memory_limit == self.memory_limit else ()
        for mine, theirs in zip(self._pricers(), base._pricers()):
            agrees: dict[tuple, bool] = {}

            def same(submesh: Submesh, shape: tuple[int, int]) -> bool:
                if (submesh, shape) not in agrees:
                    agrees[(submesh, shape)] = \
                        mine._context(submesh, shape) == theirs._context(submesh, shape) \
                        and mine.deep_in_flight(submesh) == theirs.deep_in_flight(submesh)
                return agrees[(submesh, shape)]

            for key, cost in theirs._costed.items():
                if key not in mine._costed and same(*key[1:3]):
                    mine._costed[key] = cost
                    taken += 1
            plans = {**theirs._free_plans, **{k: s.solution for k, s in theirs._free.items()
                                              if s is not None}}
            for key, plan in plans.items():
                if same(*key[1:]):
                    mine._free_plans.setdefault(key, plan)
            mine._revealed |= {r for r in theirs._revealed if same(*r[:2])}
            for table in wholes:   # by `whole_key`: (structure, submesh, logical shape, ...)
                ours, known = getattr(mine, table), getattr(theirs, table)
                for key, value in known.items():
                    if key not in ours and same(*key[1:3]):
                        ours[key] = value
                        taken += table == "_whole_costs"
        self._gates.update(base._gates)
        return taken

    def _prices_like(self, base: "StageProfiler") -> bool:
        """Whether ``base`` prices this profiler's layers as it does, given the same cost
        context: the same layers (by structure) and parts, micro-batch count, options
        (shared parameters included), optimizer state, and layers priced by parts where
        this profiler would (`_by_parts` decides on `_sample_mesh`'s prices: the same
        sample, on the same context)."""
        if (base.microbatches, base.options, base.optimizer_state, base.in_parts) != \
                (self.microbatches, self.options, self.optimizer_state, self.in_parts):
            return False
        n = self.layering.num_layers
        if base.layering.num_layers != n or \
                [base.key(m, m + 1) for m in range(n)] != [self.key(m, m + 1) for m in range(n)]:
            return False
        spans = [p[0].spans if p is not None else None for p in (self._parts, base._parts)]
        sample = self._sample_mesh()
        return spans[0] == spans[1] and sample == base._sample_mesh() and \
            (sample is None or self._context(*sample) == base._context(*sample))

    def _map(self, method: str, tasks: list[tuple], workers: int | None,
             parallel_from: int | None = None) -> Iterator:
        """``self.<method>(*t) for t in tasks`` (each returning its result and its solve
        count), lazily and in order, on ``workers`` forked processes (default: the usable
        cores) when there are at least ``parallel_from`` tasks (default `PARALLEL_FROM_TASKS`):
        fork shares the program and the caches without pickling."""
        return _run_tasks(self, [(method, t) for t in tasks], workers, parallel_from)

    def _price_all(self, layers: tuple[int, ...], submesh: Submesh, shape: tuple[int, int]
                   ) -> tuple[dict[tuple, _Costed | None], int, list[dict[tuple, IlpSolution]]]:
        """Every variant of ``layers`` (one-layer ranges) on ``submesh`` laid out as ``shape``
        (but the deferred ones): the priced costs by `_costed` key, the solves it took and,
        where variants were deferred, the fastest plans their pricing starts from (this
        profiler's, then its part pricer's)."""
        before = self.solves
        for m in layers:
            self._exact(m, m + 1, submesh, shape, "free")
        variants = self.variants(submesh, shape)   # decided by the "free" costs just priced
        costs = {(self.key(m, m + 1), submesh, shape, b): self._exact(m, m + 1, submesh, shape, b)
                 for b in variants if not self._deferred(submesh, shape, b) for m in layers}
        deferred = any(self._deferred(submesh, shape, b) for b in variants)
        plans = [{k: v.solution for k, v in p._free.items()
                  if v is not None and k[1:] == (submesh, shape)} if deferred else {}
                 for p in self._pricers()]
        return costs, self.solves - before, plans

    def _pricers(self) -> list["StageProfiler"]:
        """This profiler and its part pricer (`_part_pricer`), if it has one."""
        return [self] + ([self._parts[1]] if self._parts is not None else [])

    # ------------------------------------------------------------------ deferred variants
    def _deferred(self, submesh: Submesh, shape: tuple[int, int], budget: str) -> bool:
        return self.lazy and budget in LAZY_VARIANTS and \
            (submesh, shape, budget) not in self._revealed

    def _placeholder(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int]
                     ) -> _Costed | None:
        """A lower bound of every memory-trading plan of ``[start, end)`` on ``submesh`` laid
        out as ``shape``, in each figure the DP reads: their latency is at least the fastest
        plan's ("free": the same ILP with one constraint fewer; less `PLACEHOLDER_SLACK`,
        what the solves are proved to), their replay at least one device's forward spread
        over the submesh's, and each of their bytes at least one device's spread over it (a
        plan shards or replicates; it holds no value fewer times). The DP on these bounds
        finds a pipeline no slower than it finds on the plans; where that pipeline uses a
        bound, the plans it stands for are priced (`reveal`) and the DP runs again."""
        free = self._exact(start, end, submesh, shape, "free")
        if free is None:
            return None   # no plan of that logical mesh at all
        lat = free.latency * (1.0 - PLACEHOLDER_SLACK)
        one = self._costed.get((self.key(start, end), (1, 1), (1, 1), "free"))
        if one is None:   # no one-device price to spread (host-granular): bytes unbounded
            return _Costed(lat, lat, 0.0, 0.0, 0.0, lat, 0.0, 0.0, free.cores, False)
        n = submesh[0] * submesh[1]
        replay = max(one.recompute_latency - one.latency, 0.0) / n
        return _Costed(lat, lat + replay, one.state / n, one.act / n, one.inputs / n, lat,
                       one.selective_act / n, 0.0, free.cores, False)

    def deferred_in(self, stages: Iterable[StagePlacement]) -> set[tuple]:
        """The deferred variants ``(submesh, shape, variant)`` whose bounds the DP's
        ``stages`` were priced by (their labels name them; a mixed plan's lean part too)."""
        out = set()
        for s in stages:
            label = s.option.label
            for variant in LAZY_VARIANTS:
                if variant in label.budget:
                    key = (self.priced_as(s.submesh), label.logical_shape, variant)
                    if self._deferred(*key):
                        out.add(key)
        return out

    def deferred_on(self, submesh: Submesh) -> set[tuple]:
        """Every deferred variant of ``submesh`` (its memory may bind there)."""
        submesh = self.priced_as(submesh)
        return {(submesh, shape, v) for shape in self.shapes(submesh)
                for v in self.variants(submesh, shape) if self._deferred(submesh, shape, v)}

    def reveal(self, entries: Iterable[tuple], workers: int | None = None) -> None:
        """Price the deferred variants ``(submesh, shape, variant)`` for every layer, those
        of one logical mesh in one task (they share its formulation), the tasks on forked
        workers as `prefetch`'s; the DP's tables then read them."""
        todo = sorted({(self.priced_as(sub), shape, v) for sub, shape, v in entries
                       if self._deferred(self.priced_as(sub), shape, v)})
        if not todo:
            return
        groups: dict[tuple, list[str]] = {}
        for sub, shape, v in todo:
            groups.setdefault((sub, shape), []).append(v)
        layers = self._distinct_layers()
        tasks = [(layers, sub, shape, tuple(vs)) for (sub, shape), vs in groups.items()]
        for costs, solves in self._map("_price_variants", tasks, workers,
                                       REVEAL_PARALLEL_FROM):
            self.solves += solves
            self._costed.update(costs)
        for sub, shape, v in todo:
            self._revealed.add((sub, shape, v))
            self._sums.pop((sub, shape, v), None)

    def _price_variants(self, layers: tuple[int, ...], submesh: Submesh,
                        shape: tuple[int, int], variants: tuple[str, ...]
                        ) -> tuple[dict[tuple, _Costed | None], int]:
        """`reveal`'s task: ``variants`` of ``layers`` on ``submesh`` laid out as ``shape``."""
        before = self.solves
        self._revealed.update((submesh, shape, v) for v in variants)
        costs = {(self.key(m, m + 1), submesh, shape, v): self._exact(m, m + 1, submesh, shape, v)
                 for v in variants for m in layers}
        return costs, self.solves - before

    def _distinct_layers(self) -> tuple[int, ...]:
        """The first layer of each one-layer structure."""
        firsts: dict[str, int] = {}
        for m in range(self.layering.num_layers):
            firsts.setdefault(self.key(m, m + 1), m)
        return tuple(firsts.values())

    def _exact(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
               budget: str) -> _Costed | None:
        key = (self.key(start, end), submesh, shape, budget)
        if key not in self._costed and self._deferred(submesh, shape, budget):
            return self._placeholder(start, end, submesh, shape)
        if key not in self._costed:
            self._costed[key] = self._priced_in_parts(start, submesh, shape, budget) \
                if end - start == 1 and self._by_parts(start) else \
                self._price(start, end, submesh, shape, budget)
        return self._costed[key]

    def _by_parts(self, m: int) -> bool:
        """Whether layer ``m`` is priced by its parts (`layer_parts.py`; a layer of one part
        is that part). By parts the layer lays out the values one part hands the other for
        free, as a range of layers does at its inner boundaries; in a large layer that is
        little beside its work (GPT-39B's first layer: the same latency to 0.1 % on a host's
        meshes, 0.5-0.9 % over on (1, 2)), in a small one the layouts either side decide the
        plan (a 64-wide GPT's head layer: 27-35 % cheaper by parts, and a test's search 16 ->
        106 s on the whole solves it drew). So a split layer is checked once, on the smallest
        submesh of several devices that this profiler prices (`_sample_mesh`): priced whole
        ("free") and by parts, it is priced by parts everywhere when its latency by parts is
        at most `PARTS_BELOW` under the whole's and at most `PARTS_ABOVE` over it, else whole
        everywhere. Under is what misleads: the DP
        then favours the stage, and its whole solve finds it slower; over, by parts prices
        what the parts hand each other too (each reduces what it sends), and the layer is one
        of a stage's several (Llama-3-70B's first: 2.5 % over on (1, 2), the same plan).
        """
        if self._parts is None:
            return False
        a, b = self._parts[0].spans[m]
        if b - a == 1:
            return True
        if m not in self._gates:
            where = self._sample_mesh()
            if where is None:
                self._gates[m] = False
                return False
            sub, sample = where
            key = (self.key(m, m + 1), sub, sample, "free")
            whole = self._costed.get(key) or self._price(m, m + 1, sub, sample, "free")
            by_parts = self._priced_in_parts(m, sub, sample, "free")
            self._gates[m] = whole is not None and by_parts is not None and \
                (1 - PARTS_BELOW) * whole.latency <= by_parts.latency <= \
                (1 + PARTS_ABOVE) * whole.latency
            if not self._gates[m]:   # priced whole: this solve is its price
                self._costed[key] = whole
        return self._gates[m]

    def _sample_mesh(self) -> tuple[Submesh, tuple[int, int]] | None:
        """Where `_by_parts` compares: the smallest submesh of several devices (else one
        device) with a logical shape this profiler prices (a hand-style method allows few),
        and the first such shape; None if there is none."""
        shapes = submesh_shapes(ClusterShape(self.cluster.num_hosts,
                                             self.cluster.devices_per_host))
        subs = shapes[1:] + shapes[:1]   # by device count, one device last
        return next(((sub, self.shapes(sub)[0]) for sub in subs if self.shapes(sub)), None)

    def _priced_in_parts(self, m: int, submesh: Submesh, shape: tuple[int, int],
                         budget: str) -> _Costed | None:
        """Layer ``m`` priced as the sum of its parts (`layer_parts.py`), None when a part
        has no plan."""
        assert self._parts is not None
        parts, pricer = self._parts
        before = pricer.solves
        costs = [pricer._exact(p, p + 1, submesh, shape, budget)
                 for p in range(*parts.spans[m])]
        self.solves += pricer.solves - before
        return None if any(c is None for c in costs) else _summed(costs)

    def transfer_time(self, start: int) -> float:
        """Receiving a stage's activations and sending their gradients back, per micro-batch,
        over the slowest link between stages (another host's when the cluster has several):
        every option's price; the DP takes `link_discount` off where the stage before shares
        the host (`stage_problem.Links`)."""
        if start not in self._transfers:
            self._transfers[start] = self._transfer_time(start)
        return self._transfers[start]

    def _transfer_time(self, start: int) -> float:
        return inbound_s(self.cluster, self._boundary_bytes(start))

    def _boundary_bytes(self, start: int) -> float:
        """Bytes of one micro-batch's activations into layer ``start`` and their gradients
        (asked per layer and submesh by the DP's `Links`: kept)."""
        if start not in self._boundaries:
            g = self.stage(start, start + 1)
            self._boundaries[start] = float(sum(
                n.out.nbytes * (2 if n.requires_grad else 1) for n in g.nodes
                if n.role == "input" and n.op == "input" and not n.state_name))
        return self._boundaries[start]

    def link_discount(self, start: int, submesh: Submesh) -> float:
        """What a stage from layer ``start`` on ``submesh`` saves of `transfer_time` when the
        stage before it is on its host (`stage_problem.Links`): each device then moves its
        share of the boundary over its own link, as the simulator sends it, instead of the
        whole over the hosts' network."""
        submesh = self.priced_as(submesh)
        return self.transfer_time(start) - inbound_s(self.cluster, self._boundary_bytes(start),
                                                     submesh[0] * submesh[1])

    # ------------------------------------------------------------------ one logical shape
    def stage_cluster(self, name: str, submesh: Submesh) -> Cluster:
        """The part of the cluster a stage on ``submesh`` runs on, of the device it is priced
        on (a typed submesh's kind, else the cluster's slowest)."""
        sub = self.cluster.submesh(name, submesh[0], submesh[1])
        kind = submesh[2] if len(submesh) > 2 else len(self.kinds)
        return replace(sub, device=self.kinds[kind]) if kind < len(self.kinds) else sub

    def _context(self, submesh: Submesh, shape: tuple[int, int]) -> CostContext:
        sub = self.stage_cluster(f"{self.cluster.name}[{submesh[0]}x{submesh[1]}]", submesh)
        return CostContext(logical_mesh(sub, shape), sub.device, self.optimizer_state,
                           microbatches=self.microbatches,
                           half_copies=self.options.hold_half_copies)

    def _form(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
              tp: bool = False) -> Formulation:
        """The stage's ILP with one live set of everything (budget unset), built once per
        structure, submesh and logical shape and shared by its variants (its node names are
        those of the first range of that structure)."""
        key = (self.key(start, end), submesh, shape, tp)
        if key not in self._forms:
            self._forms[key] = self._formulate(start, end, submesh, shape, tp)
            self._form_ranges[key] = (start, end)
        return self._forms[key]

    def _form_range(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int]
                    ) -> tuple[int, int]:
        """The range whose node names the shared formulation of ``[start, end)`` uses."""
        self._form(start, end, submesh, shape)
        return self._form_ranges[(self.key(start, end), submesh, shape, False)]

    def _formulate(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
                   tp: bool = False) -> Formulation:
        options = replace(self.options, force_batch_axis=0, tensor_axis=1, full_split=True,
                          tensor_weights=True) if tp else self.options
        form = formulate(resolve_choices(self.stage(start, end), shape, options),
                         self._context(submesh, shape), 0.0,
                         share_blocks=self.options.share_blocks)
        return replace(form, problem=replace(form.problem, memory_budget=None))

    def _price(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int],
               budget: str) -> _Costed | None:
        """The time-optimal plan of the stage, "free" (no memory bound), "lean" (the fastest
        within 5 % of the smallest memory any plan of it needs: ZeRO, tensor parallelism) or
        "deep" (the same with `deep_in_flight` micro-batches kept)."""
        form = self._form(start, end, submesh, shape, budget == "tp")
        # Priced on the range the structure's formulation names (any range of it may ask
        # first), so that its solutions name the nodes of the program they are read with.
        start, end = self._form_ranges[(self.key(start, end), submesh, shape, budget == "tp")]
        free = (self.key(start, end), submesh, shape)
        if budget not in ("lean", "deep"):
            s = self._solve(start, end, form, replace(form.problem, live_sets=()))
            if budget == "free":
                self._free[free] = s
        else:
            problem = form.problem if budget == "lean" else _in_flight_problem(
                form, self.stage(*self._form_range(start, end, submesh, shape)), None,
                self.deep_in_flight(submesh))
            try:
                limit = min_memory(problem) * 1.05
            except InfeasibleIlpError:
                return None   # no plan of this kind at all (a method's restriction forbids it)
            s = self._free.get(free)
            if s is None and free in self._free_plans:
                s = StageSolution(form, self._free_plans[free], self.stage(start, end))
            # The fastest plan of all is the fastest within the limit when it fits it: the
            # same objective, one constraint more.
            if s is None or peak_memory(problem, s.solution.choices) > limit:
                s = self._solve(start, end, form, replace(problem, memory_budget=limit))
        if s is None:
            return None
        state, act, inputs = _memory_parts(s)
        latency = float(self._latency(s))
        zero3 = any(s.form.choices.choices[r][c].mode == "zero3"
                    for r, c in zip(s.form.roots, s.solution.choices))
        cores = attention_cores(s.graph)
        selective = (latency, float(act), 0.0)
        if cores and not zero3:
            replayed = frozenset(n for core in cores for n in core)
            saved = [_inner_bytes(s, core) for core in cores]
            selective = (self._recompute_latency(s, replayed), float(act) - sum(saved),
                         max(saved))
        return _Costed(latency, float(self._recompute_latency(s)), float(state), float(act),
                       float(inputs), *selective, len(cores), zero3)

    def solutions(self, chosen: list[tuple[int, int, Submesh, StageLabel, int]],
                  workers: int | None = None) -> list[StageSolution]:
        """The plans behind the options the DP chose, ``(start, end, submesh, label,
        in_flight)`` each, solved whole (module docstring): the fastest whose memory with its
        in-flight micro-batches kept (`_in_flight_problem`) fits the device limit, or without a
        limit the fastest; where nothing fits, the leanest. Stages of one structure on one
        submesh and plan kind share one solve, at the most micro-batches any of them keeps (a
        plan that fits it fits the others), so a long pipeline of repeated blocks costs a
        few solves. Each carries its latency and peak memory as the pipeline runs it."""
        chosen = self._priced_stages(chosen)
        firsts: dict[tuple, tuple] = {}
        for start, end, submesh, label, in_flight in sorted(chosen, key=lambda c: -c[4]):
            firsts.setdefault((self.key(start, end), submesh, label),
                              (start, end, submesh, label, in_flight))
        # Groups of one problem (labels differing only in the variant that priced them) and
        # problems solved before need no solve of their own.
        tasks = {self.whole_key(*first): first for first in firsts.values()}
        tasks = {k: t for k, t in tasks.items() if k not in self._wholes}
        solved = list(self._map("_solve_whole", list(tasks.values()), workers,
                                parallel_from=WHOLE_PARALLEL_FROM))
        for k, (sol, solves) in zip(tasks, solved):
            self._wholes[k] = sol
            self.solves += solves
        shared = {group: self._wholes[self.whole_key(*first)] for group, first in firsts.items()}
        out = []
        for start, end, submesh, label, in_flight in chosen:
            # Named for this very range: the plan must name its own nodes. Ranges of one
            # structure list their choices in the same order.
            form = self._named_form(start, end, submesh, label.logical_shape)
            s = StageSolution(form, shared[(self.key(start, end), submesh, label)],
                              self.stage(start, end))
            latency, memory = self._as_run(s, start, end, submesh, label, in_flight)
            out.append(replace(s, latency=latency + self.transfer_time(start),
                               memory_bytes=memory))
        return out

    def _named_form(self, start: int, end: int, submesh: Submesh, shape: tuple[int, int]
                    ) -> Formulation:
        """The formulation of ``[start, end)`` naming its own nodes: its structure's, renamed
        (`renamed`), else one of its own."""
        return renamed(self._form(start, end, submesh, shape), self.stage(start, end),
                       self.options.replicated_updates) or \
            self._formulate(start, end, submesh, shape)

    def _as_run(self, s: StageSolution, start: int, end: int, submesh: Submesh,
                label: StageLabel, in_flight: int, transients: bool = False
                ) -> tuple[float, float]:
        """(seconds per micro-batch without the inbound transfer, peak bytes per device) of
        the solved stage ``s`` of ``[start, end)`` (the range its names are of) in the
        pipeline, recomputed or not, ``in_flight`` micro-batches kept; with ``transients``
        the peak as the simulator runs a plain stage (`transient_bytes` added), else the
        ILP's (what a plan's stage reports: the simulator adds its transients itself)."""
        segments = self.segments(s.graph, end - start, label)
        weighted = _in_flight_problem(s.form, s.graph, segments, in_flight)
        latency = self._latency(s) if segments is None else self._recompute_latency(
            s, _replayed(label, end - start, segments))
        peak = peak_memory(weighted, s.solution.choices)
        extra = transient_bytes(s, segments, peak, in_flight) if transients else 0.0
        return latency, peak + extra

    def tradeoffs(self, s: StageSolution, start: int, end: int, label: StageLabel,
                  in_flight: int) -> dict[str, float]:
        """What the solved stage ``s`` of ``[start, end)`` gave up for memory, as `explain`
        states it: recomputed, the bytes per device its replay saves at ``in_flight``
        micro-batches against keeping its activations under the same plan
        (``recompute_saved_bytes``) and the seconds the replay adds to a step
        (``recompute_cost_s``); its parameters updated by ZeRO-2 and ZeRO-3
        (``zero2_params``, ``zero3_params``) and the bytes of state per device that saves
        against replicated updates of the same layouts, less ZeRO-3's gathered working set
        (``zero_saved_bytes``)."""
        out: dict[str, float] = {}
        choices = s.solution.choices
        segments = self.segments(s.graph, end - start, label)
        if segments is not None:
            kept = _in_flight_problem(s.form, s.graph, None, in_flight)
            replayed = _in_flight_problem(s.form, s.graph, segments, in_flight)
            out["recompute_saved_bytes"] = peak_memory(kept, choices) - peak_memory(replayed,
                                                                                    choices)
            replay = self._recompute_latency(s, _replayed(label, end - start, segments))
            out["recompute_cost_s"] = (replay - self._latency(s)) * self.microbatches
        mem, saved = s.form.problem.node_memory, 0.0
        counts = {"zero2": 0, "zero3": 0}
        for i, r in enumerate(s.form.roots):
            if s.graph.by_name[r].role != "param":
                continue
            options = s.form.choices.choices[r]
            chosen = options[choices[i]]
            if chosen.mode not in counts:
                continue
            counts[chosen.mode] += 1
            whole = next((j for j, o in enumerate(options)
                          if o.strategy == chosen.strategy and o.mode == "replicated"), None)
            if whole is not None:
                saved += mem[i][whole] - mem[i][choices[i]]
        if counts["zero2"] or counts["zero3"]:
            out.update(zero2_params=counts["zero2"], zero3_params=counts["zero3"],
                       zero_saved_bytes=saved - working_peak(s.form.problem, choices))
        return out

    def segments(self, stage: Graph, num_layers: int, label: StageLabel
                 ) -> dict[str, int] | None:
        """What the stage program ``stage`` of ``num_layers`` layers replays under ``label``
        (`planner/recompute.py`), or None."""
        replay = replay_of(label.kind, num_layers)
        return None if replay is None else replay.segments(stage, self.layering.layer_of)

    def prefetch_whole_costs(self, stages: list[tuple[int, int, Submesh, StageLabel, int]],
                             workers: int | None = None,
                             bounds: list[float] | None = None) -> None:
        """`whole_cost` of each ``(start, end, submesh, label, in_flight)`` ahead of time, the
        distinct uncached ones on forked workers, likely longest first, so that two long ones
        do not end up one after the other on a worker: more layers, more micro-batches in
        flight (a tighter memory bound) and a 2-D logical mesh make a whole solve slower.
        With ``bounds`` (one per stage), `whole_cost_below` of each instead."""
        stages = self._priced_stages(stages)
        bounds = bounds if bounds is not None else [math.inf] * len(stages)
        tasks = sorted(self._whole_tasks(stages, bounds).items(),
                       key=lambda t: -(t[1][1] - t[1][0]) * t[1][4] *
                       sum(n > 1 for n in t[1][3].logical_shape))
        done = self._map("_whole_cost_task", [stage for _, stage in tasks], workers,
                         parallel_from=WHOLE_PARALLEL_FROM)
        for (key, task), (sol, cost, solves) in zip(tasks, done):
            if sol is None:
                self._whole_floors[key] = task[5]
            else:
                self._wholes[key], self._whole_costs[key] = sol, cost
            self.solves += solves

    def _whole_tasks(self, stages: list[tuple[int, int, Submesh, StageLabel, int]],
                     bounds: list[float]) -> dict[tuple, tuple]:
        """The distinct uncached whole solves of ``stages``, by `whole_key`, each with the
        largest of its stages' ``bounds`` (inbound transfers taken off): a solve under it
        answers them all."""
        tasks: dict[tuple, tuple] = {}
        for stage, bound in zip(stages, bounds):
            key = self.whole_key(*stage)
            bound -= self.transfer_time(stage[0])
            if key in self._whole_costs or self._floored(key, bound):
                continue
            if key in tasks:
                bound = max(bound, tasks[key][5])
            tasks[key] = (*tasks.get(key, stage)[:5], bound)
        return tasks

    def _whole_cost_task(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                         in_flight: int, bound: float = math.inf
                         ) -> tuple[IlpSolution | None, tuple[float, float] | None, int]:
        before = self.solves
        key = self.whole_key(start, end, submesh, label, in_flight)
        if self._cut_off(start, end, submesh, label, in_flight, bound):
            return None, None, self.solves - before
        return self._wholes[key], self._whole_costs[key], self.solves - before

    def whole_key(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                  in_flight: int) -> tuple:
        """What a whole solve of the stage depends on: its structure, submesh, logical mesh,
        recomputation and in-flight micro-batches. Not the label's variant (``budget``): the
        whole solve is the unconstrained ILP under the pipeline's memory whatever variant
        priced the option, so stages of one structure that the DP priced by different
        variants share one solve."""
        return (self.key(start, end), self.priced_as(submesh), label.logical_shape, label.kind,
                in_flight)

    def whole_cost(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                   in_flight: int) -> tuple[float, float]:
        """(seconds per micro-batch, peak bytes per device) of the stage solved whole with
        ``in_flight`` micro-batches kept, as `solutions` gives them; cached by structure, so
        comparing candidate pipelines of repeated blocks costs a solve per distinct stage."""
        submesh = self.priced_as(submesh)
        key = self.whole_key(start, end, submesh, label, in_flight)
        if key not in self._whole_costs:
            # `_solve` has counted the solves already.
            sol = self._wholes[key] = self._solve_whole(start, end, submesh, label,
                                                        in_flight)[0]
            # The structure's shared formulation (no new one for this range's names).
            first = self._form_range(start, end, submesh, label.logical_shape)
            s = StageSolution(self._form(start, end, submesh, label.logical_shape), sol,
                              self.stage(*first))
            self._whole_costs[key] = self._as_run(s, *first, submesh, label, in_flight,
                                                  transients=True)
        latency, memory = self._whole_costs[key]
        return latency + self.transfer_time(start), memory

    def whole_cost_below(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                         in_flight: int, bound: float) -> tuple[float, float] | None:
        """`whole_cost`, or None when it is proved not to be under ``bound`` seconds (the
        inbound transfer included) (`_cut_off`: HiGHS given the bound as its cutoff proves it
        often long before it would prove its optimum). For choosing between a stage's logical
        meshes and recomputations: an option that cannot beat the best one found is not
        solved to the end."""
        submesh = self.priced_as(submesh)
        if self._cut_off(start, end, submesh, label, in_flight,
                         bound - self.transfer_time(start)):
            return None
        return self.whole_cost(start, end, submesh, label, in_flight)

    def _floored(self, key: tuple, bound: float) -> bool:
        """Whether whole solve ``key`` is known not to be under ``bound`` (`_cut_off`)."""
        return self._whole_floors.get(key, -math.inf) >= bound

    def _cut_off(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                 in_flight: int, bound: float) -> bool:
        """Whether the stage solved whole provably takes no less than ``bound`` seconds per
        micro-batch (without the inbound transfer): its first ILP, with the objective that
        bound allows as HiGHS's cutoff, has no point within it (found in `CUT_NODES` nodes, or
        if no point under it turns up by then, in a search to the end). True records the
        floor; False solves it whole as `whole_cost` does, the cutoff forgotten: a search
        with one sees other nodes and may end at another of several equal plans, and the
        whole solve's rounds as run depend on which (a 4-layer stage once ended 29 % slower),
        so only the proof is taken from it and every answer is the one without it."""
        key = self.whole_key(start, end, submesh, label, in_flight)
        if key in self._whole_costs:
            return False
        if self._floored(key, bound):
            return True
        if not math.isinf(bound):
            form, _, _, weighted = self._whole_problem(start, end, submesh, label, in_flight)
            problem = replace(weighted, live_sets=()) if self.memory_limit is None else \
                replace(weighted, memory_budget=self.memory_limit)
            self.solves += 1
            try:
                solve(problem, max_nodes=CUT_NODES, rel_gap=PLAN_REL_GAP,
                      cutoff=_objective_cutoff(form, bound, self.microbatches))
            except IlpCutOffError:
                self._whole_floors[key] = bound
                return True
            except InfeasibleIlpError:
                pass
        self.whole_cost(start, end, submesh, label, in_flight)
        return False

    def _solve_whole(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                     in_flight: int) -> tuple[IlpSolution, int]:
        key = self.whole_key(start, end, submesh, label, in_flight)
        if key in self._wholes:
            return self._wholes[key], 0
        return self._solve_whole_now(start, end, submesh, label, in_flight)

    def _whole_problem(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                       in_flight: int
                       ) -> tuple[Formulation, tuple[int, int], Mapping[str, int] | None,
                                  IlpProblem]:
        """What a whole solve of the stage solves: the structure's formulation, the range
        its names are of, the replayed segments and the ILP with ``in_flight`` micro-batches
        kept (before any memory limit)."""
        # The unconstrained ILP, whatever variant priced the stage: its plans include every
        # variant's, so under the same memory bound it is at least as fast. The structure's
        # shared formulation: ranges of one structure list their choices in the same order.
        form = self._form(start, end, submesh, label.logical_shape)
        first = self._form_range(start, end, submesh, label.logical_shape)
        segments = self.segments(self.stage(*first), end - start, label)
        weighted = _in_flight_problem(form, self.stage(*first), segments, in_flight)
        if segments is not None and replay_of(label.kind, end - start) != FULL:
            weighted = without_zero3(form, weighted)   # no partial replay with ZeRO-3 yet
        # Each layer its own plan: tying repeated blocks to one (the formulation's aliases)
        # is what a whole solve is there to undo, since under the pipeline's memory bound the
        # best stage mixes plans (Llama 3 70B's first stage: 4 blocks one way, 4 in three
        # others). Tied, it was 1-4 % slower than untied, and no faster to solve.
        return form, first, segments, replace(weighted, aliases=())

    def _solve_whole_now(self, start: int, end: int, submesh: Submesh, label: StageLabel,
                         in_flight: int) -> tuple[IlpSolution, int]:
        before = self.solves
        form, first, segments, weighted = self._whole_problem(start, end, submesh, label,
                                                              in_flight)
        # Solved within `plan_solve`'s node limits, not under a wall-clock limit, which
        # would make the plan depend on the load.
        if self.memory_limit is None:
            s = self._solve(start, end, form, replace(weighted, live_sets=()))
        else:
            s = self._solve(start, end, form, replace(weighted, memory_budget=self.memory_limit))
            if s is None:
                s = self._solve(start, end, form, replace(
                    weighted, memory_budget=min_memory(weighted) * (1 + 1e-9)))
            else:   # the structure's names: those of its first range
                s = self._within_as_run(*first, form, weighted, segments, in_flight,
                                        StageSolution(form, s.solution, self.stage(*first)))
        if s is None:
            raise AssertionError(f"meshplan internal error: stage [{start}, {end}) on "
                                 f"{submesh} has no plan although the DP chose one")
        return s.solution, self.solves - before

    def _within_as_run(self, start: int, end: int, form: Formulation, weighted: IlpProblem,
                       segments: Mapping[str, int] | None, in_flight: int, s: StageSolution
                       ) -> StageSolution:
        """``s``, or when its peak as run (`transient_bytes` beyond the ILP's) exceeds the
        memory limit, the stage solved again under the limit less those bytes (a few rounds:
        another plan has other transients), the last that fits or else ``s``."""
        assert self.memory_limit is not None
        for _ in range(AS_RUN_ROUNDS):
            peak = peak_memory(weighted, s.solution.choices)
            over = peak + transient_bytes(s, segments, peak, in_flight) - self.memory_limit
            if over <= 0:
                return s
            tighter = self._solve(start, end, form,
                                  replace(weighted, memory_budget=peak - over))
            if tighter is None:
                return s
            s = tighter
        return s

    def _solve(self, start: int, end: int, form: Formulation, problem: IlpProblem
               ) -> StageSolution | None:
        """The ILP's answer (`plan_solve`: the best within its node limits), or None when
        nothing fits."""
        self.solves += 1
        try:
            sol = plan_solve(problem)
        except InfeasibleIlpError:
            return None
        return StageSolution(form, sol, self.stage(start, end))

    def _latency(self, s: StageSolution) -> float:
        # At least 0: a stage of nearly free nodes (Gemma 2's leading layers) came out at
        # -2e-28 s, the objective less its tie-break in rounding.
        tie = s.form.ctx.tie_break * sum(_memory_parts(s, working=False))
        return max((s.solution.objective - tie) / self.microbatches, 0.0)

    def _recompute_latency(self, s: StageSolution, replayed: frozenset[str] | None = None
                           ) -> float:
        """The same plan with its forward (the nodes of ``replayed`` when given) run again in
        backward: their compute and forward collectives once more (`recompute_extra_s` prices
        a fixed plan without rebuilding the ILP). Free, lean and Megatron-style solves often
        agree: cached by plan."""
        key = (id(s.form), s.solution.choices, replayed)
        if key not in self._extras:  # the entry keeps the form alive, so its id stays its own
            self._extras[key] = (s.form, recompute_extra_s(s.form, s.solution.choices,
                                                           s.form.ctx, replayed))
        return self._latency(s) + self._extras[key][1] / self.microbatches


def _objective_cutoff(form: Formulation, bound: float, microbatches: int) -> float:
    """The ILP objective above which a stage's plan takes more than ``bound`` seconds per
    micro-batch: `StageProfiler._latency` is the objective less the tie-break on its plan's
    memory, per micro-batch (recomputation only adds), so the memory's largest tie-break on
    top of ``bound`` per step."""
    largest = math.fsum(max((m for m in row if math.isfinite(m)), default=0.0)
                        for row in form.problem.node_memory)
    return bound * microbatches + form.ctx.tie_break * largest


def _replayed(label: StageLabel, num_layers: int, segments: Mapping[str, int]
              ) -> frozenset[str] | None:
    """What `StageProfiler._recompute_latency` replays of a recomputed stage: None for its
    whole forward, else the nodes of its replayed segments."""
    return None if replay_of(label.kind, num_layers) == FULL else frozenset(segments)


def inbound_s(cluster: Cluster, nbytes: float, inside: int | None = None) -> float:
    """Seconds per micro-batch of a stage boundary's ``nbytes`` (activations in, gradients
    back): across hosts the whole over the hosts' network (on one host, over a device's link);
    with ``inside`` devices receiving, the stages on either side on one host, each device its
    share over its own link, as the simulator sends it, if that is faster."""
    if not nbytes:
        return 0.0
    link = cluster.inter_host if cluster.num_hosts > 1 else cluster.intra_host
    across = link.latency + nbytes / link.effective_bandwidth
    if inside is None:
        return across
    own = cluster.intra_host
    return min(across, own.latency + nbytes / inside / own.effective_bandwidth)


# A split layer is priced by its parts where, on a sample mesh, they price it at most this
# much under and over its whole solve (`StageProfiler._by_parts`).
PARTS_BELOW = 0.01
PARTS_ABOVE = 0.05
# Below this many one-layer pricings, forking workers costs more than it saves.
PARALLEL_FROM_TASKS = 48

# The variants a lazy profiler prices only where the DP's pipelines use them
# (`StageProfiler.reveal`): those that trade speed for memory, each two solves (the smallest
# memory, then the fastest near it), most of a count's pricing where memory binds.
LAZY_VARIANTS = ("lean", "deep")
# How far under its shape's fastest plan a deferred variant is bounded: the planner's solves
# stop within `ilp.PLAN_ACCEPT`'s 0.5 % of their proof, so a variant's solve may come out
# that much under the fastest plan's.
PLACEHOLDER_SLACK = 0.01
# Whole solves of long stages take seconds each: two already pay for the fork.
WHOLE_PARALLEL_FROM = 2
# A revealed logical mesh is two solves per variant and layer, formulated anew wherever it
# runs (its "free" task's formulation was a worker's): two pay for the fork too.
REVEAL_PARALLEL_FROM = 2
_FORKED: StageProfiler | None = None   # the profiler forked workers price for


def _run_tasks(prof: StageProfiler, jobs: list[tuple[str, tuple]], workers: int | None,
               parallel_from: int | None = None) -> Iterator:
    """``prof.<method>(*args)`` for each job ``(method, args)`` (returning its result and its
    solve count), lazily and in order; on ``workers`` forked processes (default: the usable
    cores) when there are at least ``parallel_from`` jobs (default `PARALLEL_FROM_TASKS`):
    fork shares the program and the caches without pickling."""
    workers = workers or usable_cores()
    if workers < 2 or len(jobs) < (parallel_from or PARALLEL_FROM_TASKS):
        for method, args in jobs:
            before = prof.solves
            out = getattr(prof, method)(*args)
            prof.solves = before  # the tasks report their solves, as forked ones must
            yield out
        return
    global _FORKED
    _FORKED = prof
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            yield from pool.map(_call_forked, jobs,
                                chunksize=max(1, len(jobs) // (16 * workers)))
    finally:
        _FORKED = None


def _call_forked(job: tuple[str, tuple]) -> object:
    assert _FORKED is not None, "_run_tasks sets the profiler before forking"
    method, args = job
    return getattr(_FORKED, method)(*args)


def usable_cores() -> int:
    env = os.environ.get("MESHPLAN_WORKERS")
    if env:
        return max(1, int(env))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


# Branch-and-bound nodes `StageProfiler._cut_off` searches before it gives up proving that
# no plan of a whole solve beats another option's and solves it for its answer, where a point
# under the cutoff has shown up by then (where none has, the search goes on to the proof or
# the first such point). The root alone: Llama 3 70B's (2, 2) options, 4-6 % slower than
# (1, 4), are all proved so; GPT-39B's that win are probed for no more than their root
# (50 nodes cost those 3 s of its 37).
CUT_NODES = 1

# Rounds of `StageProfiler._within_as_run`.
AS_RUN_ROUNDS = 3


def transient_bytes(s: StageSolution, segments: Mapping[str, int] | None = None,
                    ilp_peak: float | None = None, in_flight: int = 1) -> float:
    """Bytes per device a stage's plan ``s`` holds beyond the ILP's peak as the simulator
    runs it in a pipeline: the op-by-op peak of a forward, or of a backward into gradients
    already held (the gradients in flight next to the ones summed into), beyond one
    micro-batch's kept activations (`liveness.step_peaks`). The ILP's live sets hold the
    kept activations and every gradient at once, and nothing in between.

    Recomputed (``segments``: each replayed node's segment), the walk is segment by segment
    (`liveness.segmented_peaks`) and a micro-batch keeps its segments' inputs; the simulator's
    peak is then the state, ``in_flight`` micro-batches' kept bytes and the largest pass
    beyond them (`sim.task_costs`), and the transient is what it exceeds ``ilp_peak`` (the
    in-flight ILP's peak, which holds one segment's activations, not the replay's gradients
    in flight). GPT-39B's and MoE-70B's recomputed first stages simulated 11 % and 21 % over
    the V100's 16 GiB without it."""
    nc = s.form.choices
    peaks = step_peaks_of(OpCosts(nc, s.form.ctx), nc, node_indices(s.form, s.solution.choices),
                          segments)
    state, act, inputs = _memory_parts(s)
    if segments is None:
        return max(peaks.forward_peak - act - inputs, peaks.backward_held_peak - act - inputs,
                   0.0)
    assert ilp_peak is not None, "a recomputed stage's transient is relative to its ILP peak"
    kept = peaks.kept_bytes
    passing = max(peaks.forward_peak, peaks.backward_held_peak,
                  peaks.backward_peak - peaks.grad_bytes) - kept
    return max(state + in_flight * kept + max(passing, 0.0) - ilp_peak, 0.0)


def _memory_parts(s: StageSolution, working: bool = True) -> tuple[float, float, float]:
    """(state, activations, received inputs) bytes per device of a solved stage; the state
    includes the ZeRO-3 working set (held once whatever is in flight) unless ``working`` is
    false (what the ILP's objective charged)."""
    mem, roots, by = s.form.problem.node_memory, s.form.roots, s.graph.by_name
    parts = {"param": 0.0, "act": 0.0, "in": 0.0}
    for i, r in enumerate(roots):
        role = by[r].role
        part = "param" if role == "param" else "in" if role in ("input", "target") else "act"
        parts[part] += mem[i][s.solution.choices[i]]
    state = parts["param"] + (working_peak(s.form.problem, s.solution.choices) if working
                               else 0.0)
    return state, parts["act"], parts["in"]


def _in_flight_problem(form: Formulation, stage: Graph, segments: Mapping[str, int] | None,
                       in_flight: int) -> IlpProblem:
    """The stage's ILP with memory as the pipeline holds it with ``in_flight`` micro-batches:
    state once; without recomputation (``segments`` None) every activation and input
    ``in_flight`` times; recomputed segment by segment (``segments``: each replayed node's
    segment, `planner/recompute.py`), the inputs and every value read outside its segment
    ``in_flight`` times, plus one segment's own activations (a live set per segment)."""
    users = stage.users
    kept, per_segment = [], {}
    scaled = []
    for i, r in enumerate(form.roots):
        n = stage.by_name[r]
        seg = None if segments is None else segments.get(r)
        once = n.role == "param" or (seg is not None and n.role == "op" and all(
            segments.get(u) == seg for u in users[r]))
        scaled.append(tuple(m * (1 if once else in_flight) for m in form.problem.node_memory[i]))
        if once and n.role != "param":
            per_segment.setdefault(seg, []).append(i)
        else:
            kept.append(i)
    live = tuple(tuple(kept + ids) for ids in per_segment.values()) or (tuple(kept),)
    return replace(form.problem, node_memory=tuple(scaled), live_sets=live)


def _inner_bytes(s: StageSolution, core: frozenset[str]) -> float:
    """Bytes per device the plan ``s`` keeps of the values of ``core`` read only inside it:
    what replaying the core saves per micro-batch."""
    nc, idx = s.form.choices, node_indices(s.form, s.solution.choices)
    costs = OpCosts(nc, s.form.ctx)
    users = s.graph.users
    return float(sum(costs.memory(s.graph.by_name[n], nc.choices[n][idx[n]]) for n in core
                     if all(u in core for u in users[n])))
