"""A plan's pipeline as static per-rank instructions: the schedule's clock table, which values
each stage sends to which, and every rank's instruction list (`instructions.py`).

Each stage of a plan runs on its own devices (global ranks, row-major over the stage's logical
mesh) with its own intra-operator plan. Under interleaved 1F1B a mesh runs ``chunks`` virtual
stages: stage s of S·v on the devices of stage s % S, each with its own intra plan. A value crosses stages when a stage's plan receives it
as an ``"input"`` source named after an op of an earlier stage (`stage_graph`): it leaves the
producer in the layout of its ``stage_output`` sink's operand and arrives in the layout the
consumer's plan gives that source. `Exchange` records that move; the runtime turns it into a
cross-mesh resharding plan (`cross_mesh.py`) once it knows the value's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost.precision import with_compute_dtype
from meshplan.ir.graph import BUFFER_WRITE, Graph
from meshplan.lower.instructions import Instruction, mesh_programs
from meshplan.lower.schedules import Schedule, make_schedule
from meshplan.plan.plan import Plan, StagePlan
from meshplan.planner.inter.stage_graph import cut_stage

SINK_SUFFIX = "__stage_output"   # `planner.inter.stage_graph`'s sink naming


@dataclass(frozen=True)
class Exchange:
    """Value ``value`` moves from stage ``src`` (laid out ``src_spec``) to stage ``dst``
    (``dst_spec``), every micro-batch; its gradient goes back the same way."""

    value: str
    src: int
    dst: int
    src_spec: str
    dst_spec: str


@dataclass(frozen=True)
class PipelineProgram:
    """Everything each rank runs in one step, as plain data."""

    schedule: Schedule
    meshes: tuple[tuple[int, ...], ...]        # per mesh: its global ranks
    mesh_shapes: tuple[tuple[int, int], ...]   # per mesh: its logical mesh
    exchanges: tuple[Exchange, ...]
    programs: tuple[tuple[Instruction, ...], ...]   # per mesh

    def mesh_of(self, rank: int) -> int:
        """The mesh rank ``rank`` belongs to. Raises ValueError if none."""
        for s, ranks in enumerate(self.meshes):
            if rank in ranks:
                return s
        total = sum(len(m) for m in self.meshes)
        raise ValueError(f"rank {rank} is not in this plan's {total} ranks (0..{total - 1})")

    def stages_on(self, mesh: int) -> tuple[int, ...]:
        """The (virtual) stages mesh ``mesh`` runs, in pipeline order."""
        return tuple(range(mesh, self.schedule.num_stages, self.schedule.num_meshes))

    def for_rank(self, rank: int) -> tuple[Instruction, ...]:
        return self.programs[self.mesh_of(rank)]

    def exchanges_of(self, ins: Instruction) -> list[Exchange]:
        """The values a SEND or RECV moves."""
        if ins.op == "SEND" and ins.kind == "activation" or \
                ins.op == "RECV" and ins.kind == "gradient":
            src, dst = ins.stage, ins.peer
        else:
            src, dst = ins.peer, ins.stage
        return [e for e in self.exchanges if e.src == src and e.dst == dst]


def pipeline_program(plan: Plan) -> PipelineProgram:
    """The per-rank instructions of ``plan`` (module docstring). Raises ValueError for a
    schedule the runtime cannot run or virtual stages of one mesh on different devices."""
    meshes = _meshes(plan.stages, plan.chunks)
    schedule = make_schedule(plan.schedule, len(meshes), plan.microbatches, plan.chunks)
    exchanges = pipeline_exchanges(plan)
    sends: dict[int, list[int]] = {}
    for e in exchanges:
        if e.dst not in sends.setdefault(e.src, []):
            sends[e.src].append(e.dst)
    programs = mesh_programs(schedule, sends)
    return PipelineProgram(schedule, tuple(tuple(s.devices) for s in meshes),
                           tuple(tuple(s.mesh_shape) for s in meshes), tuple(exchanges),
                           tuple(tuple(p) for p in programs))


def pipeline_exchanges(plan: Plan) -> tuple[Exchange, ...]:
    """The values ``plan``'s stages send one another, without the instruction lists (which
    grow with stages x micro-batches: GPT-3's 72 stages of 1536 take seconds). Raises
    ValueError as `pipeline_program` does."""
    _meshes(plan.stages, plan.chunks)
    return tuple(_exchanges(plan.stages)) if len(plan.stages) > 1 else ()


def _meshes(stages: tuple[StagePlan, ...], chunks: int) -> tuple[StagePlan, ...]:
    """The first stage of each mesh, after checking every virtual stage s runs on the devices
    and logical mesh of stage s % S."""
    if chunks < 1 or len(stages) % chunks:
        raise ValueError(f"a plan of {len(stages)} stages cannot have {chunks} model chunks per "
                         "mesh: the stage count must be a positive multiple of the chunks")
    s = len(stages) // chunks
    for st in stages[s:]:
        first = stages[st.index % s]
        if (tuple(st.devices), tuple(st.mesh_shape)) != (tuple(first.devices),
                                                         tuple(first.mesh_shape)):
            raise ValueError(f"virtual stage {st.index} runs on devices {list(st.devices)} as "
                             f"{tuple(st.mesh_shape)}, but with {chunks} chunks per mesh it "
                             f"must share stage {first.index}'s {list(first.devices)} as "
                             f"{tuple(first.mesh_shape)}")
    return stages[:s]


def _exchanges(stages: tuple[StagePlan, ...]) -> list[Exchange]:
    producer: dict[str, int] = {}
    for s in stages:
        assert s.plan is not None, "a stage of a multi-stage plan carries its own plan"
        for o in s.plan.ops:
            if not o.node.endswith(SINK_SUFFIX):
                producer[o.node] = s.index
    out = []
    for s in stages:
        for src in s.plan.sources:
            origin = producer.get(src.node)
            if src.role != "input" or origin is None or origin == s.index:
                continue
            sink = stages[origin].plan.op(src.node + SINK_SUFFIX)
            out.append(Exchange(src.node, origin, s.index, sink.inputs[0], src.spec))
    return out


def format_rank_program(program: PipelineProgram, rank: int) -> str:
    """``meshplan show-program``'s text: a header, then one instruction per line with the
    values each SEND/RECV moves."""
    s = program.mesh_of(rank)
    sc = program.schedule
    stages = program.stages_on(s)
    which = f"stage {s} of {sc.num_meshes}" if len(stages) == 1 else \
        f"mesh {s} of {sc.num_meshes} (virtual stages {list(stages)} of {sc.num_stages})"
    head = [f"rank {rank}: {which} on ranks {list(program.meshes[s])} (logical mesh "
            f"{program.mesh_shapes[s]}); schedule {sc.name}, {sc.num_microbatches} "
            f"micro-batches, {sc.num_clocks} clocks, bubble {sc.bubble_fraction():.1%}"]
    lines = []
    for ins in program.for_rank(rank):
        text = str(ins)
        if ins.op in ("SEND", "RECV"):
            # A gradient goes back: from the consumer's layout to the producer's.
            moved = ", ".join(f"{e.value} [{e.src_spec} -> {e.dst_spec}]"
                              if ins.kind == "activation" else
                              f"{e.value} [{e.dst_spec} -> {e.src_spec}]"
                              for e in program.exchanges_of(ins))
            text += f": {moved}"
        lines.append(text)
    return "\n".join(head + lines)


def stage_graphs(graph: Graph, plan: Plan, check: bool = True) -> list[Graph]:
    """Each stage's program, cut from ``graph`` (the model traced at one micro-batch, as the
    plan was made) where the stage plans put their ops, at the plan's compute dtype as the
    planner priced it. Raises ValueError if a stage's program is not the one its plan was made
    for (another model, batch or meshplan version); ``check`` false: another batch shape's,
    whose sizes differ."""
    typed = with_compute_dtype(graph, plan.dtype)
    where = {o.node: s.index for s in plan.stages for o in (s.plan.ops if s.plan else ())
             if not o.node.endswith(SINK_SUFFIX)}
    missing = [n.name for n in typed.nodes if n.role == "op" and n.name not in where]
    if missing:
        raise ValueError(f"the plan's stages do not place ops {missing[:5]} of this model's "
                         "program: the plan was made for another program; make a new plan")
    _check_buffer_writes(typed, where)
    out = []
    for s in plan.stages:
        g = cut_stage(typed, where, s.index, s.index + 1)
        if s.plan is None or check and g.fingerprint() != s.plan.graph_fingerprint:
            raise ValueError(f"stage {s.index}'s program differs from the one its plan was made "
                             "for (different model, shapes or batch); make a new plan")
        out.append(g)
    return out


def _check_buffer_writes(graph: Graph, where: dict[str, int]) -> None:
    """NotImplementedError where a stage reads a buffer that another stage updates: each
    stage holds its own copy of a buffer, so the reader would never see the update."""
    for n in graph.nodes:
        if n.op != BUFFER_WRITE:
            continue
        buffer = n.inputs[0]
        readers = {where[u] for u in graph.users[buffer] if u in where} - {where[n.name]}
        if readers:
            name = graph.by_name[buffer].state_name
            raise NotImplementedError(
                f"buffer {name!r} is updated by pipeline stage {where[n.name]} and read by "
                f"stage {min(readers)}: meshplan keeps a buffer in each stage that uses it and "
                "does not send its updates between stages. Plan fewer stages (or one: "
                "method='intra-only'), or compute the update where the buffer is read")


def recompute_layers(graph: Graph, plan: Plan) -> dict[str, int]:
    """Each node's clustered layer, as the plan's search clustered ``graph`` (the model traced
    at one micro-batch) into ``plan.num_layers``: what a recomputed stage checkpoints one by
    one (Megatron-LM's full recomputation, as the stage DP prices it)."""
    from meshplan.planner.inter.clustering import cluster_layers
    typed = with_compute_dtype(graph, plan.dtype)
    balance = "ops" if plan.method == "equal-operator" else "flops"
    return dict(cluster_layers(typed, plan.num_layers, balance=balance).layer_of)
