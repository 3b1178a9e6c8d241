"""The plan: everything needed to run, explain and replay a parallel training step.

A `Plan` is plain data with a versioned JSON form: no process group, solver or fx graph is needed
to read, save, explain or diff one. It binds to a program by node names of the traced graph and
carries a fingerprint of that graph, so a plan replayed on another model fails loudly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

PLAN_VERSION = 3
# Version 1 had no training-step fields, version 2 no overlap (`buckets`, `units`): they take
# their defaults, and the runtime synchronizes as those versions did (`lower/overlap.py`).
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class OpDecision:
    """One op's chosen strategy and what it costs (seconds, or abstract α/β units)."""

    node: str
    op: str
    strategy: str
    inputs: tuple[str, ...]        # sharding spec each operand is consumed in
    output: str                    # sharding spec of the result
    grad_partial: tuple[tuple[int, ...], ...]  # per operand: axes its gradient is partial over
    compute: float
    communication: float   # reducing this op's partial sums; sync of parameters it uses
    resharding: float      # moving operands into the layouts this op needs (fwd + bwd)
    memory_bytes: float
    sync_axes: tuple[int, ...] = ()  # axes the op all-reduces its statistics over (batch norm)


@dataclass(frozen=True)
class ParamDecision:
    """A parameter's compute layout (``spec``), how it is kept (``storage``) and updated."""

    name: str
    node: str
    spec: str
    storage: str
    update: str
    sync_axes: tuple[int, ...]


@dataclass(frozen=True)
class SourceDecision:
    """How a batch tensor (an input or the target) is split across devices; ``name`` is its
    name in the batch (``input0``, a keyword, ``target``: `capture/batch.py`)."""

    node: str
    role: str
    spec: str
    name: str = ""


@dataclass(frozen=True)
class CollectiveEntry:
    """``count`` collectives of one kind, size and phase on the same mesh axes."""

    kind: str
    bytes: int
    mesh_axes: tuple[int, ...]
    phase: str
    count: int
    segment: int = 0   # the model segment whose shard weights it runs on (`Plan.segment_of`)


@dataclass(frozen=True)
class SyncGroup:
    """Parameters the runtime moves as one collective (DESIGN.md §8): a gradient *bucket* of
    replicated parameters, all-reduced as soon as all their gradients are complete in the
    step's last backward; or a ZeRO-3 *unit*, gathered whole by one all-gather and its gradient
    reduce-scattered by one. ``params``: node names; ``axes``: the mesh axes it spans;
    ``bytes``: its local tensors' total (what the collective moves, B of DESIGN.md §4)."""

    params: tuple[str, ...]
    axes: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class AsyncEntry:
    """A collective the runtime issues without waiting for it, placed on the compute of its
    pass: issued once ``issue_s`` seconds of the pass's compute are done, needed by the compute
    at ``wait_s`` (None: only after the pass — a ZeRO gradient reduce-scatter is drained when
    its backward ends, a gradient bucket at the update). ``during``: "forward" or "backward"
    (every micro-batch's) or "last_backward" (the step's last backward only). The simulator
    and the planner's estimate run these on a communication stream beside the compute."""

    kind: str
    bytes: int
    mesh_axes: tuple[int, ...]
    during: str
    issue_s: float
    wait_s: float | None = None


@dataclass(frozen=True)
class TransferEntry:
    """``count`` point-to-point messages of ``bytes`` from global rank ``src`` to ``dst`` per
    step of a pipeline: ``kind`` "activation" or "gradient" (a value crossing stages),
    "gather" (a slice of a local all-gather among destination replicas) or "tied" (the
    gradient part of a parameter several stages hold). ``stages``: the (sending, receiving)
    virtual stages of the value it carries; () for "tied"."""

    kind: str
    src: int
    dst: int
    bytes: int
    count: int
    stages: tuple[int, ...] = ()


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: clustered layers ``[layers[0], layers[1])`` on ``devices`` (global
    ids, host-major) forming a ``submesh`` of (hosts, devices per host), viewed as the logical
    ``mesh_shape``; ``in_flight`` micro-batches kept at peak under the plan's schedule;
    ``latency_s`` forward + backward of one micro-batch; ``memory_bytes`` peak per device of
    the stage's state and its activations at ``in_flight`` (under interleaving a mesh holds
    the sum over its virtual stages).
    ``recompute``: the stage replays some of its forward in backward, ``recompute_scope``
    "layers": each clustered layer checkpointed on its own (Megatron's full recomputation: per
    micro-batch only what each layer receives is kept, one layer's activations at a time in
    backward), only its first ``recompute_layers`` when given; "attention": only each
    attention core (Megatron's selective recomputation). `planner/recompute.py`.
    ``plan`` is the stage's intra-operator plan, or None for a single-stage plan, whose intra
    plan is the enclosing `Plan` itself."""

    index: int
    layers: tuple[int, int]
    devices: tuple[int, ...]
    submesh: tuple[int, int]
    mesh_shape: tuple[int, int]
    recompute: bool
    in_flight: int
    latency_s: float
    memory_bytes: float
    plan: "Plan | None" = None
    recompute_scope: str = "layers"
    recompute_layers: int | None = None
    # What the stage gave up for memory and what that bought (`StageProfiler.tradeoffs`):
    # the replay's bytes saved and seconds per step, ZeRO's parameters and state saved.
    tradeoffs: dict[str, float] | None = None


@dataclass(frozen=True)
class Plan:
    """An intra-operator parallel plan on one logical mesh (see the module docstring)."""

    model: str
    graph_fingerprint: str
    mesh_shape: tuple[int, int]
    alpha: tuple[float, float]
    beta: tuple[float, float]
    cluster: dict[str, Any]
    method: str
    optimizer: dict[str, Any]
    ops: tuple[OpDecision, ...]
    params: tuple[ParamDecision, ...]
    sources: tuple[SourceDecision, ...]
    collectives: tuple[CollectiveEntry, ...]
    objective: float
    objective_units: str
    search_time_s: float
    ilp: dict[str, float]
    predicted: dict[str, float]
    loss_partial_axes: tuple[int, ...] = ()
    axis_weights: tuple[tuple[float, ...], ...] = ()
    # The training step: compute dtype ("fp32", "bf16", "fp16"), the global batch cut into
    # ``microbatches`` with gradients accumulated, the forward recomputed during backward
    # (what of it: ``recompute_scope`` and ``recompute_layers``, as `StagePlan`'s).
    dtype: str = "fp32"
    microbatches: int = 1
    recompute: bool = False
    # Pipeline stages in order; empty for a single-stage plan made on one given mesh. A plan of
    # several stages has no ops/params/sources of its own: each stage's `plan` holds them.
    stages: tuple[StagePlan, ...] = ()
    schedule: str = "1f1b"
    # Model chunks per stage mesh (interleaved 1F1B's virtual stages): ``stages`` lists
    # ``len(stages) / chunks`` meshes' worth of virtual stages, stage s on the devices of s % S.
    chunks: int = 1
    # Point-to-point messages between ranks per step (`lower/stage_transfers.py`).
    transfers: tuple[TransferEntry, ...] = ()
    num_layers: int = 1
    # HAP §5.2: a single-stage plan cut into model segments, each with its own per-axis shard
    # weights (``segment_weights[k]``, as ``axis_weights``); ``segment_of`` names every node's
    # segment. A value split on an axis whose weights differ is re-cut (an all-to-all) where a
    # segment other than its producer's reads it. Empty: one segment, ``axis_weights``.
    segment_weights: tuple[tuple[tuple[float, ...], ...], ...] = ()
    segment_of: dict[str, int] = field(default_factory=dict)
    # Overlap of communication with compute (DESIGN.md §8), what the runtime follows: the
    # gradient buckets in launch order, the ZeRO-3 units in forward order with the order
    # the backward gathers the kept ones again (``unit_regather``) and reduce-scatters them
    # (``unit_scatter``), units gathered ``prefetch`` ahead of their use; ``overlap``: the
    # collectives so issued, where they fall on the passes' compute.
    buckets: tuple[SyncGroup, ...] = ()
    units: tuple[SyncGroup, ...] = ()
    unit_regather: tuple[int, ...] = ()
    unit_scatter: tuple[int, ...] = ()
    prefetch: int = 1
    overlap: tuple[AsyncEntry, ...] = ()
    version: int = PLAN_VERSION
    options: dict[str, Any] = field(default_factory=dict)
    recompute_scope: str = "layers"
    recompute_layers: int | None = None

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def num_stages(self) -> int:
        """Pipeline stages, virtual ones included (interleaved 1F1B: ``chunks`` per mesh)."""
        return max(len(self.stages), 1)

    @property
    def num_meshes(self) -> int:
        """Stage meshes: the distinct device groups the stages run on."""
        return max(len(self.stages) // max(self.chunks, 1), 1)

    def stage_meshes(self) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
        """Per stage mesh: its ``(logical mesh shape, global ranks)``, what the pipeline
        runtime's communicators are built from."""
        return [(tuple(s.mesh_shape), tuple(s.devices)) for s in self.stages[:self.num_meshes]]

    def op(self, node: str) -> OpDecision:
        return self._ops_by_node()[node]

    def _ops_by_node(self) -> dict[str, OpDecision]:
        return {o.node: o for o in self.ops}

    def param(self, name: str) -> ParamDecision:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r} in this plan")

    def to_json(self) -> dict[str, Any]:
        """The JSON document of the plan (the CLI's ``--json``)."""
        d = asdict(self)
        d["params"] = {p.name: {k: v for k, v in asdict(p).items() if k != "name"}
                       for p in self.params}
        d["stages"] = [asdict(replace(s, plan=None)) | {"plan": s.plan and s.plan.to_json()}
                       for s in self.stages]
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def explain(self) -> str:
        from meshplan.plan.explain import explain
        return explain(self)


def _tuples(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def plan_from_json(d: dict[str, Any]) -> Plan:
    """Rebuild a plan from its JSON document. Raises ValueError on another version or a bad file."""
    if not isinstance(d, dict):
        raise ValueError(f"a plan is a JSON object (as 'meshplan plan -o' writes it), got a "
                         f"{type(d).__name__}")
    if d.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"plan version {d.get('version')!r} is not supported; this meshplan "
                         f"reads versions {list(READABLE_VERSIONS)}")
    try:
        params = tuple(ParamDecision(name=k, **{f: _tuples(v) for f, v in p.items()})
                       for k, p in d["params"].items())
        ops = tuple(OpDecision(**{f: _tuples(v) for f, v in o.items()}) for o in d["ops"])
        sources = tuple(SourceDecision(**s) for s in d["sources"])
        colls = tuple(CollectiveEntry(**{f: _tuples(v) for f, v in c.items()})
                      for c in d["collectives"])
        stages = tuple(StagePlan(**{f: _tuples(v) for f, v in s.items() if f != "plan"},
                                 plan=s["plan"] and plan_from_json(s["plan"]))
                       for s in d.get("stages", ()))
        transfers = tuple(TransferEntry(**{f: _tuples(v) for f, v in t.items()})
                          for t in d.get("transfers", ()))
        groups = {k: tuple(SyncGroup(**{f: _tuples(v) for f, v in g.items()})
                           for g in d.get(k, ())) for k in ("buckets", "units")}
        overlap = tuple(AsyncEntry(**{f: _tuples(v) for f, v in e.items()})
                        for e in d.get("overlap", ()))
        rest = {k: _tuples(v) if k not in ("cluster", "optimizer", "ilp", "predicted", "options",
                                           "segment_of")
                else v for k, v in d.items()
                if k not in ("params", "ops", "sources", "collectives", "stages", "transfers",
                             "buckets", "units", "overlap")}
        rest["stages"] = stages
        rest["transfers"] = transfers
        rest.update(groups, overlap=overlap)
        rest["version"] = PLAN_VERSION
        return Plan(ops=ops, params=params, sources=sources, collectives=colls, **rest)
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a meshplan plan document: {e}") from e


def load_plan(path: str | Path) -> Plan:
    """Read a plan saved with `Plan.save`."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"plan file {str(p)!r} does not exist")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"plan file {str(p)!r} is not valid JSON: {e}") from e
    try:
        return plan_from_json(doc)
    except ValueError as e:
        raise ValueError(f"plan file {str(p)!r}: {e}") from e
