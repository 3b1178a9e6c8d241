"""Worker of the checkpoint tests (real gloo processes: DCP coordinates over the world)."""

from __future__ import annotations

from typing import Any

import meshplan
from oracle import cpu_capture, cpu_workload
from user_loop import parallel, train_steps


def resume_and_train(rank: int, nprocs: int, plan: meshplan.Plan, spec: str, data: list,
                     load: str | None, save: str, step: int) -> tuple[list[float], Any]:
    """Under ``plan``: resume from ``load`` (None: start afresh), train on ``data``, save to
    ``save`` with the step count; returns the losses and what the loaded checkpoint said.
    The parameter groups' learning rates come back with the checkpoint, so the schedule
    (chainable) goes on from where it stopped."""
    w = cpu_workload(spec)   # `parallel` trains a copy of it, on the process's capture
    model, opt, sched = parallel(w, plan, captured=cpu_capture(spec, plan.microbatches))
    extra = meshplan.load_checkpoint(load, model, opt) if load else {}
    losses = train_steps(model, opt, sched, data)
    meshplan.save_checkpoint(save, model, opt, extra={"step": step + len(data)})
    return losses, extra
