"""Static per-mesh instruction lists of a pipeline step (Alpa §6): the contract the runtime and
the simulator both read. Plain data: no tensors, no torch.distributed, no callables.

From a schedule's clock table (`schedules.py`) and which stages exchange values
(``sends[s]``: the later stages that read something stage s produces), every mesh gets, clock
by clock, for its task:

- forward of stage s on micro-batch j: ``RECV`` the activations of j from each stage that
  feeds s, ``RUN`` the forward, ``SEND`` s's outputs of j to each stage that reads them;
- backward: ``RECV`` the gradients of s's outputs from each stage that read them, ``RUN`` the
  backward, ``SEND`` the gradients of s's received inputs back to their producers, ``FREE`` the
  activations of j kept for it;

and after the last clock ``APPLY_GRAD`` per stage it holds (gradients accumulated over the
micro-batches by the backwards; synchronized within the stage's mesh and applied). Each SEND or
RECV is one cross-mesh resharding task (`cross_mesh.py`): the ranks of a mesh share the list
and each does its own part of the task. A RECV always matches a SEND of an earlier clock, so
sends may be asynchronous and receives blocking without deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshplan.lower.schedules import Schedule

OPS = ("RUN", "SEND", "RECV", "FREE", "APPLY_GRAD")


@dataclass(frozen=True)
class Instruction:
    """``op`` of virtual stage ``stage`` at ``clock``. RUN: ``kind`` forward/backward of
    ``microbatch``. SEND/RECV: ``kind`` "activation" or "gradient" of ``microbatch``, to/from
    stage ``peer``. FREE: the activations of ``microbatch``. APPLY_GRAD: the update."""

    clock: int
    op: str
    stage: int
    microbatch: int = -1
    kind: str = ""
    peer: int = -1

    def __str__(self) -> str:
        head = f"{self.clock:>4}  {self.op:<10} stage {self.stage}"
        if self.op == "RUN":
            return f"{head}  {self.kind} mb {self.microbatch}"
        if self.op in ("SEND", "RECV"):
            way = "to" if self.op == "SEND" else "from"
            return f"{head}  {self.kind} mb {self.microbatch} {way} stage {self.peer}"
        if self.op == "FREE":
            return f"{head}  activations of mb {self.microbatch}"
        return head


def mesh_programs(schedule: Schedule, sends: Mapping[int, Sequence[int]]
                  ) -> list[list[Instruction]]:
    """Each mesh's instruction list (module docstring). ``sends[s]``: the later stages reading
    an output of stage s (default: none). Raises ValueError if a send goes backwards or out of
    range."""
    n = schedule.num_stages
    for s, peers in sends.items():
        if any(not s < d < n for d in peers):
            raise ValueError(f"stage {s} sends to {list(peers)}: a stage sends only to later "
                             f"stages among {n}")
    feeds: dict[int, list[int]] = {d: [] for d in range(n)}
    for s in sorted(sends):
        for d in sorted(set(sends[s])):
            feeds[d].append(s)
    out: list[list[Instruction]] = [[] for _ in range(schedule.num_meshes)]
    for clock, row in enumerate(schedule.clocks):
        for mesh, task in enumerate(row):
            if task is None:
                continue
            s, j, prog = task.stage, task.microbatch, out[mesh]
            if task.kind == "forward":
                prog += [Instruction(clock, "RECV", s, j, "activation", p) for p in feeds[s]]
                prog.append(Instruction(clock, "RUN", s, j, "forward"))
                prog += [Instruction(clock, "SEND", s, j, "activation", d)
                         for d in sorted(set(sends.get(s, ())))]
            else:
                prog += [Instruction(clock, "RECV", s, j, "gradient", d)
                         for d in sorted(set(sends.get(s, ())))]
                prog.append(Instruction(clock, "RUN", s, j, "backward"))
                prog += [Instruction(clock, "SEND", s, j, "gradient", p) for p in feeds[s]]
                prog.append(Instruction(clock, "FREE", s, j))
    last = len(schedule.clocks)
    for mesh, prog in enumerate(out):
        prog += [Instruction(last, "APPLY_GRAD", s) for s in range(n)
                 if schedule.mesh_of(s) == mesh]
    return out


def chain(num_stages: int) -> dict[int, list[int]]:
    """``sends`` of a plain chain: each stage feeds the next."""
    return {s: [s + 1] for s in range(num_stages - 1)}


def format_program(program: Sequence[Instruction]) -> str:
    """One instruction per line, ``clock  OP  stage …``."""
    return "\n".join(str(i) for i in program)
