"""Event-driven execution of the per-mesh instruction lists (`lower/instructions.py`) on a
virtual clock: the same lists the pipeline runtime executes, with each task's duration from
the cost model instead of a device.

Every device of a stage mesh runs the same SPMD program, so a mesh is one actor with one
compute stream (its collectives run inside its tasks, as the runtime issues them: in line,
between the ops that need them). A mesh walks its list in order:

- ``RUN`` occupies the stream for the task's duration (`TaskCost`);
- ``SEND`` starts a transfer when the stream reaches it and does not wait for it (the runtime's
  sends are asynchronous); transfers between the same two meshes share one link, one after
  another;
- ``RECV`` waits until the matching transfer has arrived (the runtime's receives block);
- ``FREE`` releases one micro-batch's kept activations;
- ``APPLY_GRAD`` runs the update of one stage: its gradient synchronization and optimizer.

A mesh blocked on a receive whose send no mesh can reach any more is a deadlock in the lists:
`ValueError`, never a wrong number.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from meshplan.lower.instructions import Instruction


@dataclass(frozen=True)
class TaskCost:
    """What one virtual stage's tasks cost on its mesh, per device: seconds of one
    micro-batch's forward and backward (collectives and any recomputation included) and of
    the update; the parameter, gradient and optimizer state it holds (``grad_bytes`` of it
    are gradients, made by the stage's first backward); the activations one micro-batch keeps
    from its forward to its backward; and what a pass holds only while it runs:
    ``working_bytes`` (a ZeRO-3 parameter gathered whole, a ZeRO parameter's whole gradient),
    and beyond the kept activations the forward's temporaries (``forward_extra_bytes``) and
    the backward's gradients in flight, with the gradients it makes on the first micro-batch
    (``backward_extra_bytes``) or accumulating into held ones (``backward_held_extra_bytes``).
    """

    forward_s: float
    backward_s: float
    update_s: float
    state_bytes: float
    activation_bytes: float
    working_bytes: float = 0.0
    grad_bytes: float = 0.0
    forward_extra_bytes: float = 0.0
    backward_extra_bytes: float = 0.0
    backward_held_extra_bytes: float = 0.0


@dataclass(frozen=True)
class Span:
    """``what`` ("forward", "backward", "update", "wait") of ``stage`` on ``microbatch`` (-1:
    none) occupying mesh ``mesh`` from ``start`` to ``end`` seconds."""

    mesh: int
    stage: int
    microbatch: int
    what: str
    start: float
    end: float


@dataclass(frozen=True)
class Transfer:
    """The ``kind`` ("activation", "gradient") values of ``microbatch`` moving from stage
    ``src_stage`` on mesh ``src_mesh`` to stage ``dst_stage`` on ``dst_mesh``."""

    src_mesh: int
    dst_mesh: int
    src_stage: int
    dst_stage: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated step: the spans of every mesh, the transfers, each mesh's memory per
    device as (time, bytes) steps, and the step's length."""

    spans: tuple[Span, ...]
    transfers: tuple[Transfer, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    step_time_s: float

    @property
    def num_meshes(self) -> int:
        return len(self.memory)

    def to_json(self) -> dict:
        """The timeline as plain JSON: spans, transfers and memory steps per mesh."""
        return {"step_time_s": self.step_time_s,
                "spans": [asdict(s) for s in self.spans],
                "transfers": [asdict(t) for t in self.transfers],
                "memory": [[list(step) for step in steps] for steps in self.memory]}

    def peak_memory(self) -> list[float]:
        """Per mesh: the largest bytes per device at any moment."""
        return [max(b for _, b in steps) for steps in self.memory]

    def busy_s(self) -> list[float]:
        """Per mesh: the seconds it computes (forward, backward, update). One pass over the
        spans, not one per mesh: GPT-3's 72 meshes have 220,000."""
        busy = [0.0] * self.num_meshes
        for s in self.spans:
            if s.what != "wait":
                busy[s.mesh] += s.end - s.start
        return busy

    def bubble_fraction(self) -> float:
        """The share of the meshes' time in the step spent idle, averaged over meshes (0 for
        one mesh that never waits)."""
        if self.step_time_s <= 0:
            return 0.0
        idle = [1 - b / self.step_time_s for b in self.busy_s()]
        return max(sum(idle) / len(idle), 0.0)


def simulate_programs(programs: Sequence[Sequence[Instruction]], costs: Mapping[int, TaskCost],
                      mesh_of: Callable[[int], int],
                      transfer_s: Callable[[Instruction, int, int], float]) -> Timeline:
    """Run ``programs`` (one instruction list per mesh) on the virtual clock (module
    docstring). ``costs[stage]``: the tasks of each virtual stage; ``mesh_of(stage)``: the mesh
    it runs on; ``transfer_s(send, src_mesh, dst_mesh)``: seconds one SEND's values take.
    Raises ValueError on a stage without costs or lists that deadlock."""
    n = len(programs)
    missing = sorted({i.stage for p in programs for i in p} - set(costs))
    if missing:
        raise ValueError(f"no task costs for stages {missing}; the plan's stages are "
                         f"{sorted(costs)}")
    clock = [0.0] * n
    pc = [0] * n
    spans: list[Span] = []
    transfers: list[Transfer] = []
    arrivals: dict[tuple[str, int, int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    held = [sum(costs[s].state_bytes - costs[s].grad_bytes for s in costs if mesh_of(s) == m)
            for m in range(n)]
    made_grads: set[int] = set()   # stages whose gradients exist (in `held`)
    memory = [[(0.0, held[m])] for m in range(n)]

    def note(m: int, when: float, delta: float) -> None:
        held[m] += delta
        memory[m].append((when, held[m]))

    while any(pc[m] < len(programs[m]) for m in range(n)):
        moved = False
        for m in range(n):
            while pc[m] < len(programs[m]):
                ins = programs[m][pc[m]]
                if ins.op == "RECV":
                    key = (ins.kind, ins.peer, ins.stage, ins.microbatch)
                    if key not in arrivals:
                        break
                    if arrivals[key] > clock[m]:
                        spans.append(Span(m, ins.stage, ins.microbatch, "wait", clock[m],
                                          arrivals[key]))
                        clock[m] = arrivals[key]
                elif ins.op == "SEND":
                    dst = mesh_of(ins.peer)
                    start = max(clock[m], link_free.get((m, dst), 0.0))
                    end = start + transfer_s(ins, m, dst)
                    link_free[(m, dst)] = end
                    arrivals[(ins.kind, ins.stage, ins.peer, ins.microbatch)] = end
                    transfers.append(Transfer(m, dst, ins.stage, ins.peer, ins.kind,
                                              ins.microbatch, start, end))
                elif ins.op == "RUN":
                    c = costs[ins.stage]
                    forward = ins.kind == "forward"
                    took = c.forward_s if forward else c.backward_s
                    start, clock[m] = clock[m], clock[m] + took
                    first = not forward and ins.stage not in made_grads
                    passing = c.working_bytes + (
                        c.forward_extra_bytes if forward else
                        c.backward_extra_bytes if first else c.backward_held_extra_bytes)
                    if forward:
                        note(m, start, c.activation_bytes)
                    if passing:
                        note(m, start, passing)
                        note(m, clock[m], -passing)
                    spans.append(Span(m, ins.stage, ins.microbatch, ins.kind, start, clock[m]))
                elif ins.op == "FREE":
                    # The backward's peak counted the gradients it made while it released
                    # the activations: they change places at once.
                    grown = 0.0 if ins.stage in made_grads else costs[ins.stage].grad_bytes
                    made_grads.add(ins.stage)
                    note(m, clock[m], grown - costs[ins.stage].activation_bytes)
                elif ins.op == "APPLY_GRAD":
                    c = costs[ins.stage]
                    start, clock[m] = clock[m], clock[m] + c.update_s
                    spans.append(Span(m, ins.stage, -1, "update", start, clock[m]))
                else:
                    raise ValueError(f"unknown instruction {ins.op!r}")
                pc[m] += 1
                moved = True
        if not moved:
            stuck = {m: str(programs[m][pc[m]]).strip() for m in range(n)
                     if pc[m] < len(programs[m])}
            raise ValueError(f"the instruction lists deadlock: each remaining mesh waits for a "
                             f"value no mesh will send ({stuck})")
    return Timeline(tuple(spans), tuple(transfers), tuple(tuple(s) for s in memory),
                    max(clock, default=0.0))
