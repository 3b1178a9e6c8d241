"""Worker of the checkpoint tests (real gloo processes: DCP coordinates over the world)."""

from __future__ import annotations

import functools
from typing import Any

import meshplan
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.zoo.spec import Workload, build_workload
from user_loop import parallel, train_steps


@functools.cache
def _seeded(spec: str) -> Workload:
    """The seeded workload, built once per worker process (`parallel` trains a copy of it)."""
    return build_workload(spec, device="cpu", seed=0)


@functools.cache
def _captured(spec: str, microbatches: int) -> Any:
    """The workload's capture at one micro-batch, made once per worker process and handed to
    ``parallelize(captured=...)``: each run's model is a fresh copy (a new object, so meshplan's
    per-model memo would trace it again for all 13 runs of a test), of the same program."""
    w = _seeded(spec)
    return capture(w.model, w.loss_fn, split_microbatches(w.example_batch, microbatches)[0])


def resume_and_train(rank: int, nprocs: int, plan: meshplan.Plan, spec: str, data: list,
                     load: str | None, save: str, step: int) -> tuple[list[float], Any]:
    """Under ``plan``: resume from ``load`` (None: start afresh), train on ``data``, save to
    ``save`` with the step count; returns the losses and what the loaded checkpoint said.
    The parameter groups' learning rates come back with the checkpoint, so the schedule
    (chainable) goes on from where it stopped."""
    w = _seeded(spec)
    model, opt, sched = parallel(w, plan, captured=_captured(spec, plan.microbatches))
    extra = meshplan.load_checkpoint(load, model, opt) if load else {}
    losses = train_steps(model, opt, sched, data)
    meshplan.save_checkpoint(save, model, opt, extra={"step": step + len(data)})
    return losses, extra
