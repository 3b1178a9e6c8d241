"""Value types of the stage–submesh problem (Alpa §5): cluster, options, schedules, solution.

Only numbers and opaque labels cross this boundary (STYLE §4): the caller profiles a layer range
``[start, end)`` on a submesh ``(hosts, devices)`` and returns `StageOption`s; the DP in
`meshplan.planner.inter.stage_dp` never sees a graph, an ILP or torch.

Pipeline latency of stages with per-micro-batch latencies ``t_1..t_S`` and ``B`` micro-batches
(Alpa eq. 2)::

    T = sum_i t_i + (B - 1) * max_i t_i

A stage option fits a device at position ``i`` (0 = first) of ``S`` stages iff (Alpa eq. 5)::

    state_bytes + activation_bytes * in_flight(i, S, B) <= device_memory
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from meshplan.cost.checks import check_count, check_nonnegative, check_positive

Submesh = tuple[int, ...]  # (hosts, devices per host), and a device kind on typed clusters


@dataclass(frozen=True)
class ClusterShape:
    """The physical ``(num_hosts, devices_per_host)`` mesh the pipeline must cover exactly.
    ``divisor_widths``: the submeshes inside a "host" also take every divisor of
    ``devices_per_host`` (`submesh_shapes`)."""

    num_hosts: int
    devices_per_host: int
    divisor_widths: bool = False

    def __post_init__(self) -> None:
        check_count(self.num_hosts, "ClusterShape.num_hosts")
        check_count(self.devices_per_host, "ClusterShape.devices_per_host")

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host


@dataclass(frozen=True)
class StageOption:
    """One way to run a stage on a submesh, as profiled by the caller.

    ``latency``: seconds of forward + backward of one micro-batch, inbound activation transfer
    included. ``state_bytes``: parameters, gradients and optimizer state per device.
    ``activation_bytes``: activations kept per in-flight micro-batch per device. ``label``: the
    caller's opaque, hashable tag (logical mesh, recompute flag, ...). Raises TypeError/ValueError
    for a negative or non-finite number.
    """

    latency: float
    state_bytes: float = 0.0
    activation_bytes: float = 0.0
    label: Hashable = None

    def __post_init__(self) -> None:
        # Profiles return hundreds of thousands of options: plain finite floats pass quickly.
        lat, state, act = self.latency, self.state_bytes, self.activation_bytes
        if type(lat) is float and type(state) is float and type(act) is float and \
                0.0 <= lat < math.inf and 0.0 <= state < math.inf and 0.0 <= act < math.inf:
            return
        check_nonnegative(self.latency, "StageOption.latency")
        check_nonnegative(self.state_bytes, "StageOption.state_bytes")
        check_nonnegative(self.activation_bytes, "StageOption.activation_bytes")

    def memory_bytes(self, in_flight: int) -> float:
        """Peak bytes per device while ``in_flight`` micro-batches' activations are kept."""
        return self.state_bytes + self.activation_bytes * in_flight


Profile = Callable[[int, int, Submesh], tuple[StageOption, ...]]


@dataclass(frozen=True, eq=False)
class OptionTable:
    """Every option of every triple ``(start, end, submesh index)`` as columns, for a profile
    that prices all ranges at once (`PipelineProblem.table`). Row j is the option
    ``profile(start, end, submeshes[m])[position[j]]`` with ``triple[j] = (start * (L + 1) +
    end) * len(submeshes) + m``; the rows of one triple appear in position order."""

    latency: np.ndarray
    state: np.ndarray
    activation: np.ndarray
    triple: np.ndarray
    position: np.ndarray


def triple_index(start: int | np.ndarray, end: int | np.ndarray, m: int | np.ndarray,
                 num_layers: int, num_submeshes: int) -> int | np.ndarray:
    """The flat index of triple ``(start, end, m)`` (`OptionTable.triple`)."""
    return (start * (num_layers + 1) + end) * num_submeshes + m
InFlight = Callable[[int, int, int], int]


def one_f_one_b(stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches a stage holds at peak under synchronous 1F1B: ``min(S - i, B)``."""
    return min(num_stages - stage_index, num_microbatches)


def gpipe(stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches a stage holds at peak under GPipe (all forwards first): ``B``."""
    return num_microbatches


def most_in_flight(schedule: str, num_layers: int, num_devices: int, microbatches: int
                   ) -> int:
    """The most micro-batches a stage of any pipeline the searches weigh keeps in flight on
    ``schedule`` ("gpipe" or "1f1b", interleaved 1F1B included): GPipe keeps every one;
    1F1B's stage i of S keeps S - i, and S is at most the layers and the devices; interleaved
    1F1B's virtual stages keep at most 2S (its warm-up,
    `lower.schedules.Schedule.in_flight_of`), where v >= 2 chunks on each of S meshes divide
    the layers, so 2S is at most the layers and twice the devices. A small model at many
    micro-batches (ViT on HAP's 64 GPUs at 4,096) keeps a dozen, not thousands."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, num_layers, 2 * num_devices)


def submesh_shapes(cluster: ClusterShape) -> tuple[Submesh, ...]:
    """Alpa's submesh shapes: ``(1, 2^k)`` for ``2^k <= M`` (and ``(1, M)``), then ``(k, M)``.

    ``k`` runs over 2..N for the multi-host shapes. With ``cluster.divisor_widths`` (the
    host-granular search, where a "device" is a whole host) ``(1, d)`` for every divisor d of
    M as well: equal stages of d hosts tile the cluster whatever d is (Megatron-LM's 1T runs 64
    stages of 6 DGX hosts on 384), and only such stages split a model's equal blocks evenly
    when M / d is no power of two. Sorted by device count, no duplicates.
    """
    m = cluster.devices_per_host
    widths = {1 << k for k in range(m.bit_length()) if (1 << k) <= m}
    widths.add(m)  # M need not be a power of two: whole hosts must still be usable
    if cluster.divisor_widths:
        widths.update(d for d in range(1, m + 1) if m % d == 0)
    return tuple((1, w) for w in sorted(widths)) + \
        tuple((k, m) for k in range(2, cluster.num_hosts + 1))


@dataclass(frozen=True)
class DeviceKinds:
    """The DP's devices in a fixed order, each of a kind (``kinds[p]`` of position ``p``, an
    index into ``names``), for a cluster of mixed devices: a stage on positions ``[p, p + n)``
    is of one kind when all its devices are, else of kind ``mixed`` (= ``len(names)``). The DP
    lays stages on positions in pipeline order, so a stage's kind follows from the devices
    left after it, and each kind prices its stages on its own devices."""

    kinds: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.kinds or any(not 0 <= k < len(self.names) for k in self.kinds):
            raise ValueError(f"DeviceKinds.kinds must index names {self.names}, got "
                             f"{self.kinds}")

    @property
    def mixed(self) -> int:
        return len(self.names)

    def kind_of(self, start: int, count: int) -> int:
        """The kind of a stage on positions ``[start, start + count)``."""
        found = set(self.kinds[start:start + count])
        return found.pop() if len(found) == 1 else self.mixed

    def shapes(self, base: tuple[Submesh, ...]) -> tuple[Submesh, ...]:
        """Every base submesh once per kind, mixed included, ``(hosts, devices, kind)``, where
        some run of that many positions is of that kind: the rest could never be laid (HAP's
        4 or 8 hosts of V100 where there are 2, one host of mixed kind), and each shape asked
        is priced by the caller (a V100-typed (4, 8) stage cost as much as a real one)."""
        return tuple((*shape, k) for shape in base for k in range(self.mixed + 1)
                     if self._laid_anywhere(shape[0] * shape[1], k))

    def _laid_anywhere(self, count: int, kind: int) -> bool:
        return any(self.kind_of(start, count) == kind
                   for start in range(len(self.kinds) - count + 1))

    def mask(self, shapes: tuple[Submesh, ...]) -> np.ndarray:
        """``(len(shapes), D + 1)``: 0 where a stage of ``shapes[m]`` may start with ``d``
        devices left (its positions are of its kind), inf elsewhere."""
        total = len(self.kinds)
        out = np.full((len(shapes), total + 1), np.inf)
        for m, (hosts, devices, kind) in enumerate(shapes):
            n = hosts * devices
            for d in range(n, total + 1):
                if self.kind_of(total - d, n) == kind:
                    out[m, d] = 0.0
        return out


@dataclass(frozen=True)
class Links:
    """Which link each stage boundary runs on, for a DP that lays its stages on contiguous
    device positions in pipeline order (`placement.place_submeshes` does so whenever the
    shapes allow it, and the DP then only picks shapes that do): a stage of shape ``(1, w)``
    starting at position ``o`` stays inside one host (``o % M + w <= M``), one of ``(h, M)``
    starts at a host's first device. A boundary at a position inside a host joins two stages
    of that host, whose transfer runs over the devices' own links; at a host's edge it crosses
    the hosts' network. Options are priced across hosts; ``discount(start, submesh)`` is what a
    stage starting at layer ``start`` on ``submesh`` saves when its inbound boundary is inside a
    host (>= 0)."""

    discount: Callable[[int, Submesh], float]


def placeable(shape: Submesh, offset: int, devices_per_host: int) -> bool:
    """Whether a stage of ``shape`` fits contiguous positions from ``offset`` (`Links`)."""
    hosts, devices = shape[0], shape[1]
    if hosts > 1:
        return offset % devices_per_host == 0
    return offset % devices_per_host + devices <= devices_per_host


def inside_host(offset: int, devices_per_host: int) -> bool:
    """Whether a boundary at position ``offset`` (> 0) of contiguous stages is inside a host."""
    return offset % devices_per_host != 0


def laid_in_order(stages: tuple["StagePlacement", ...], devices_per_host: int) -> bool:
    """Whether ``stages`` fit contiguous positions in pipeline order (`Links`)."""
    offset = 0
    for s in stages:
        if not placeable(s.submesh, offset, devices_per_host):
            return False
        offset += s.num_devices
    return True


def linked(stages: tuple["StagePlacement", ...], links: "Links | None", devices_per_host: int
           ) -> tuple["StagePlacement", ...]:
    """``stages`` laid contiguously in order (`Links`), each whose inbound boundary is inside a
    host with its option's latency less its discount; unchanged without ``links`` or when the
    shapes cannot be laid so."""
    if links is None or not laid_in_order(stages, devices_per_host):
        return stages
    offsets = np.cumsum([0] + [s.num_devices for s in stages])
    return tuple(replace(s, option=replace(s.option, latency=s.option.latency
                                           - links.discount(s.start, s.submesh)))
                 if i and inside_host(int(o), devices_per_host) else s
                 for i, (s, o) in enumerate(zip(stages, offsets)))


def pipeline_latency(latencies: tuple[float, ...], num_microbatches: int, chunks: int = 1
                     ) -> float:
    """Seconds of one iteration of B micro-batches through stages of ``latencies`` (forward +
    backward of one micro-batch each).

    One chunk per mesh (GPipe, 1F1B): Alpa eq. 2, ``sum(t) + (B - 1) * max(t)``. Interleaved
    1F1B with v = ``chunks`` virtual stages per mesh (stage k on mesh k % S): with W_i the work
    of mesh i per micro-batch (its chunks' latencies summed), ``B * max(W) + (sum(W) -
    max(W)) / v``, Megatron-LM's bubble of (S - 1) / v stage times generalized to unequal
    meshes as eq. 2 generalizes (S - 1); with v = 1 it is eq. 2. For equal chunks it is
    exactly the clock table's length (`lower/schedules.py`: 2 (B v + S - 1) half-chunk
    clocks)."""
    if chunks == 1:
        return math.fsum(latencies) + (num_microbatches - 1) * max(latencies)
    meshes = len(latencies) // chunks
    work = [math.fsum(latencies[i::meshes]) for i in range(meshes)]
    return num_microbatches * max(work) + (math.fsum(work) - max(work)) / chunks


@dataclass(frozen=True)
class PipelineProblem:
    """Everything the stage DP needs.

    ``num_layers`` L: layers 0..L-1, a stage is a range ``[start, end)``. ``profile(start, end,
    submesh)`` returns the stage's options on that submesh; an empty tuple means impossible.
    ``device_memory``: bytes per device, None for unlimited. ``in_flight(i, S, B)``: micro-batches
    whose activations stage ``i`` of ``S`` keeps at peak; the DP requires it to depend on
    ``S - i`` and ``B`` only (checked by `resolve_in_flight_counts`). Raises TypeError/ValueError
    naming a bad field.
    """

    cluster: ClusterShape
    num_layers: int
    profile: Profile
    num_microbatches: int = 1
    device_memory: float | None = None
    in_flight: InFlight = one_f_one_b
    # Optional: ``table(submeshes)`` gives every triple's options at once, exactly as
    # ``profile`` would (a profiler that prices all ranges by vectorized sums); the DP then
    # asks ``profile`` only for the stages it picks.
    table: Callable[[tuple[Submesh, ...]], OptionTable] | None = None
    # A cluster of mixed devices: each stage's kind follows from its positions, and the
    # profile is asked for typed submeshes ``(hosts, devices, kind)`` (`DeviceKinds`).
    kinds: DeviceKinds | None = None
    # Stages on contiguous positions in order, each boundary priced on its link (`Links`).
    links: Links | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterShape):
            raise TypeError(f"PipelineProblem.cluster must be a ClusterShape, got {self.cluster!r}")
        check_count(self.num_layers, "PipelineProblem.num_layers")
        check_count(self.num_microbatches, "PipelineProblem.num_microbatches")
        if self.device_memory is not None:
            check_positive(self.device_memory, "PipelineProblem.device_memory")
        for name in ("profile", "in_flight"):
            if not callable(getattr(self, name)):
                raise TypeError(f"PipelineProblem.{name} must be callable, got "
                                f"{getattr(self, name)!r}")
        if self.kinds is not None and len(self.kinds.kinds) != self.cluster.num_devices:
            raise ValueError(f"PipelineProblem.kinds has {len(self.kinds.kinds)} positions; "
                             f"the cluster has {self.cluster.num_devices} devices")
        if self.links is not None and self.kinds is not None:
            raise ValueError("PipelineProblem.links and .kinds cannot both be set: typed "
                             "stages are laid on their hosts, not on contiguous positions")
        if self.table is not None and not callable(self.table):
            raise TypeError(f"PipelineProblem.table must be callable or None, got "
                            f"{self.table!r}")

    @property
    def max_stages(self) -> int:
        """Each stage has at least one layer and one device."""
        return min(self.num_layers, self.cluster.num_devices)

    def fits(self, option: StageOption, in_flight: int) -> bool:
        """Whether ``option`` fits a device while ``in_flight`` micro-batches are kept (eq. 5)."""
        return self.device_memory is None or option.memory_bytes(in_flight) <= self.device_memory


def resolve_in_flight_counts(problem: PipelineProblem) -> tuple[int, ...]:
    """``counts[r]``: in-flight micro-batches of a stage with ``r`` stages left (itself included).

    ``counts[0]`` is unused (0). The DP runs from the last layer backwards and knows only how many
    stages remain, so ``in_flight(i, S, B)`` must equal ``counts[S - i]`` for every ``S`` up to
    `max_stages`; otherwise raises ValueError. Non-int or negative counts raise too.
    """
    s_max, b = problem.max_stages, problem.num_microbatches
    counts = [0] + [problem.in_flight(0, r, b) for r in range(1, s_max + 1)]
    for r, count in enumerate(counts[1:], start=1):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"in_flight(0, {r}, {b}) must be an int >= 0, got {count!r}")
    for s in range(1, s_max + 1):
        for i in range(s):
            if (got := problem.in_flight(i, s, b)) != counts[s - i]:
                raise ValueError(
                    f"in_flight({i}, {s}, {b}) = {got!r} but in_flight(0, {s - i}, {b}) = "
                    f"{counts[s - i]!r}: the stage DP needs an in-flight count that depends only "
                    "on the number of stages from the end (like one_f_one_b or gpipe)")
    return tuple(counts)


def profile_from_table(table: Mapping[tuple[int, int, Submesh], tuple[StageOption, ...]]
                       ) -> Profile:
    """A `Profile` reading ``table[(start, end, submesh)]``; missing keys mean impossible."""
    def profile(start: int, end: int, submesh: Submesh) -> tuple[StageOption, ...]:
        return tuple(table.get((start, end, submesh), ()))
    return profile


@dataclass(frozen=True)
class StagePlacement:
    """Layers ``[start, end)`` on a ``submesh`` of ``(hosts, devices)`` with the chosen option."""

    start: int
    end: int
    submesh: Submesh
    option: StageOption
    in_flight: int

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    @property
    def kind(self) -> int | None:
        """The device kind of a typed submesh (`DeviceKinds`), else None."""
        return self.submesh[2] if len(self.submesh) > 2 else None

    @property
    def label(self) -> Hashable:
        return self.option.label


@dataclass(frozen=True)
class DpStats:
    """How the search went: t_max values evaluated, profile calls, wall seconds."""

    num_tmax_tried: int
    num_profile_calls: int
    seconds: float


@dataclass(frozen=True)
class PipelineSolution:
    """The chosen pipeline: ``total_latency`` T (eq. 2, seconds per iteration), ``t_max`` the
    slowest stage's latency, the stages in pipeline order, and search statistics."""

    total_latency: float
    t_max: float
    stages: tuple[StagePlacement, ...]
    stats: DpStats
    chunks: int = 1   # interleaved 1F1B: virtual stages per mesh, stage k on mesh k % S
    # Typed stages (`DeviceKinds`): the host ids in the order the DP laid its positions on,
    # stage after stage; () when the stages are placed by shape alone.
    hosts: tuple[int, ...] = ()


def make_solution(stages: tuple[StagePlacement, ...], num_microbatches: int,
                  stats: DpStats, chunks: int = 1, hosts: tuple[int, ...] = ()
                  ) -> PipelineSolution:
    """A `PipelineSolution` whose T and t_max are computed from ``stages`` by eq. 2 (its
    interleaved form with ``chunks`` > 1, `pipeline_latency`)."""
    latencies = tuple(stage.option.latency for stage in stages)
    return PipelineSolution(pipeline_latency(latencies, num_microbatches, chunks),
                            max(latencies), stages, stats, chunks, hosts)
