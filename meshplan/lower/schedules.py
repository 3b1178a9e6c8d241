"""Pipeline schedules as clock tables (Alpa §6): which micro-batch each mesh runs, and when.

A pipeline of S meshes runs ``chunks`` model chunks per mesh (1 for GPipe and 1F1B; v for
Megatron's interleaved 1F1B): virtual stage ``s`` of ``S * chunks`` lives on mesh ``s % S``. A
schedule is a per-mesh order of tasks (forward or backward of one virtual stage on one
micro-batch), played on a clock: at each clock every mesh runs the next task of its order if
what it needs finished at an earlier clock (the forward of the stage before; the backward of the
stage after and its own forward), else idles. One more clock applies the gradients. With one
time unit per task this is the timeline the runtime and the simulator follow, so its length and
idle slots are the pipeline's latency and bubble.

Orders:

- ``gpipe``: every forward, then every backward (all micro-batches' activations held at once).
- ``1f1b`` (PipeDream-flush, Alpa's default): mesh i runs ``S - i - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the backwards, so it never holds more
  than ``S - i`` micro-batches' activations.
- ``interleaved`` (Megatron-LM): the same with v chunks per mesh, micro-batches taken in
  groups of S through chunk 0, then chunk 1, …; warm-up ``2 (S - i - 1) + (v - 1) S`` forwards.
  Tasks are 1/v of a stage, so the bubble shrinks v-fold. Needs the micro-batch count to be a
  multiple of S (as Megatron-LM does).

For GPipe and 1F1B the table has ``2 (S + m - 1)`` clocks plus the update: Alpa's invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Task:
    """The ``kind`` ("forward" or "backward") of virtual stage ``stage`` on ``microbatch``."""

    microbatch: int
    stage: int
    kind: str


@dataclass(frozen=True)
class Schedule:
    """``clocks[t][i]``: mesh i's task at clock t (None: idle); the update clock follows."""

    name: str
    num_meshes: int
    num_microbatches: int
    chunks: int
    clocks: tuple[tuple[Task | None, ...], ...]

    @property
    def num_stages(self) -> int:
        """Virtual stages: ``chunks`` per mesh."""
        return self.num_meshes * self.chunks

    @property
    def num_clocks(self) -> int:
        """Clocks of the step, the update's included."""
        return len(self.clocks) + 1

    def mesh_of(self, stage: int) -> int:
        return stage % self.num_meshes

    def order(self, mesh: int) -> list[Task]:
        """Mesh ``mesh``'s tasks in the order it runs them."""
        return [c[mesh] for c in self.clocks if c[mesh] is not None]

    def bubble_fraction(self) -> float:
        """Idle share of the meshes' task slots (the update clock excluded)."""
        slots = len(self.clocks) * self.num_meshes
        return 1.0 - sum(t is not None for c in self.clocks for t in c) / slots

    def in_flight_of(self, stage: int) -> int:
        """Most micro-batches whose activations (virtual) stage ``stage`` keeps at once."""
        held = peak = 0
        for t in self.order(self.mesh_of(stage)):
            if t.stage == stage:
                held += 1 if t.kind == "forward" else -1
                peak = max(peak, held)
        return peak

    def max_in_flight(self, mesh: int) -> int:
        """Most micro-batch chunks whose activations mesh ``mesh`` holds at once (a forward
        keeps them until its backward)."""
        held = peak = 0
        for t in self.order(mesh):
            held += 1 if t.kind == "forward" else -1
            peak = max(peak, held)
        return peak


def make_schedule(name: str, num_meshes: int, num_microbatches: int, chunks: int = 1
                  ) -> Schedule:
    """The clock table of schedule ``name`` (module docstring). Raises ValueError for an unknown
    name, counts below 1, ``chunks`` > 1 with a schedule other than interleaved, or an
    interleaved micro-batch count that is not a multiple of the meshes."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}: must be one of {SCHEDULES}")
    for what, n in (("meshes", num_meshes), ("micro-batches", num_microbatches),
                    ("chunks", chunks)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"number of {what} must be an int >= 1, got {n!r}")
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"{name} runs one model chunk per mesh, got chunks={chunks}; use "
                         "'interleaved' for virtual stages")
    if name == "interleaved" and num_microbatches % num_meshes:
        raise ValueError(f"interleaved 1F1B takes micro-batches in groups of the {num_meshes} "
                         f"meshes; {num_microbatches} is not a multiple of {num_meshes}")
    orders = [_order(name, i, num_meshes, num_microbatches, chunks) for i in range(num_meshes)]
    return Schedule(name, num_meshes, num_microbatches, chunks,
                    _play(orders, num_meshes * chunks))


def _order(name: str, mesh: int, s: int, m: int, v: int) -> list[Task]:
    def forward(k: int) -> Task:
        return Task(_microbatch(k, s, v), ((k // s) % v) * s + mesh, "forward")

    def backward(k: int) -> Task:
        return Task(_microbatch(k, s, v), (v - 1 - (k // s) % v) * s + mesh, "backward")

    total = m * v
    if name == "gpipe":
        return [forward(k) for k in range(total)] + [backward(k) for k in range(total)]
    warmup = min(total, s - mesh - 1 if name == "1f1b" else 2 * (s - mesh - 1) + (v - 1) * s)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


def _microbatch(k: int, s: int, v: int) -> int:
    """The micro-batch of a mesh's k-th forward (or backward): groups of ``s`` per chunk."""
    return (k // (s * v)) * s + k % s if v > 1 else k


def _play(orders: list[list[Task]], num_stages: int) -> tuple[tuple[Task | None, ...], ...]:
    """Run each mesh's order on the clock (module docstring)."""
    done: set[tuple[int, int, str]] = set()
    nxt = [0] * len(orders)
    clocks = []
    while any(n < len(o) for n, o in zip(nxt, orders)):
        row: list[Task | None] = []
        for i, order in enumerate(orders):
            task = order[nxt[i]] if nxt[i] < len(order) else None
            row.append(task if task is not None and _ready(task, done, num_stages) else None)
        if all(t is None for t in row):
            raise AssertionError(f"meshplan internal error: schedule deadlocks at clock "
                                 f"{len(clocks)}")
        for i, task in enumerate(row):
            if task is not None:
                nxt[i] += 1
        done.update((t.microbatch, t.stage, t.kind) for t in row if t is not None)
        clocks.append(tuple(row))
    return tuple(clocks)


def _ready(task: Task, done: set[tuple[int, int, str]], num_stages: int) -> bool:
    j, s = task.microbatch, task.stage
    if task.kind == "forward":
        return s == 0 or (j, s - 1, "forward") in done
    return (j, s, "forward") in done and (s == num_stages - 1 or (j, s + 1, "backward") in done)
