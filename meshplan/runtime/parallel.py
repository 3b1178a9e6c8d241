"""The training loop PyTorch users already write, running a plan: ``parallelize``.

On every rank::

    model, optimizer = meshplan.parallelize(model, optimizer, plan, loss_fn)
    for batch in batches:              # the global batch, the same on every rank
        loss = model(batch)            # this rank's share of the step, the global loss's value
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

The model returned runs this rank's local program (`Trainer`) on its share of the batch (the
"data helper": every rank passes the global batch, each takes its own rows as the plan splits
them, uneven shares included) and returns the loss. The optimizer returned is the user's own
object: its parameter groups keep their hyper-parameters (weight decay per group, a scheduler's
learning rate) and now hold this rank's update tensors (a shard under ZeRO), its state starts
afresh; a step-pre hook synchronizes the gradients first (bucketed all-reduce, ZeRO's
reduce-scatters having run in backward) and clips them if the plan's optimizer says so, a post
hook refreshes ZeRO-2's compute copies. A plan of several micro-batches runs the first ones'
forward and backward inside the call (accumulating their gradients, one micro-batch's
activations held at a time, as planned) and leaves the last one's backward to
``loss.backward()``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from meshplan.capture.batch import split_microbatches
from meshplan.plan.plan import Plan
from meshplan.runtime.comm import Comm, ProcessGroupComm
from meshplan.runtime.trainer import Trainer


class ParallelModel(nn.Module):
    """``model(batch) -> loss`` on this rank under the plan (module docstring). The trainer is
    built at the first call, from that batch's shapes (the plan's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                 loss_fn: Callable | None, comm: Comm, captured: Any = None) -> None:
        super().__init__()
        self._model, self._optimizer, self._plan = [model], optimizer, plan
        self._loss_fn, self._comm, self._captured = loss_fn, comm, captured
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError("the parallel model has not run yet: call it on a batch first")
        return self._trainer

    def forward(self, batch: Any) -> torch.Tensor:
        if self._trainer is None:
            self._trainer = Trainer(self._plan, self._model[0], self._loss_fn, batch,
                                    self._comm, captured=self._captured)
            _repoint(self._optimizer, self._model[0], self._trainer)
        tr = self._trainer
        rng = tr.begin_step()
        micro = split_microbatches(batch, self._plan.microbatches)
        done = []
        for piece in micro[:-1]:   # accumulated here; the last backward is the caller's
            loss = tr._run(tr._program_args(tr.local_batch(piece)), rng)
            if torch.is_grad_enabled():
                (loss / len(micro)).backward()
                tr.own_gradients()
            done.append(loss.detach())
        last = tr._run(tr._program_args(tr.local_batch(micro[-1])), rng) / len(micro)
        local = last.detach() + sum(d / len(micro) for d in done)
        # The value reported is the whole batch's loss; the gradient flows through this
        # rank's part of the last micro-batch.
        whole = torch.tensor(tr._report(local), dtype=last.dtype)
        return last + (whole - last.detach())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by its name in the original model (every rank)."""
        return self.trainer.full_state_dict()


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                loss_fn: Callable | None = None, *, comm: Comm | None = None,
                captured: Any = None) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """The model and optimizer of this rank under ``plan`` (module docstring). ``loss_fn`` is
    the plan's (None: the model returns its own loss); ``comm`` defaults to the initialized
    torch.distributed world (``meshplan run``, ``torchrun``); ``captured``: a capture of the
    model at one micro-batch to reuse (ranks emulated as threads share one: tracing is not
    thread-safe). Raises ValueError for a
    pipeline plan (not yet: use `meshplan.runtime.pipeline.PipelineTrainer`) and RuntimeError
    when no world is initialized and no ``comm`` is given."""
    if plan.num_stages > 1:
        raise ValueError(f"parallelize runs single-stage plans; this plan has "
                         f"{plan.num_stages} pipeline stages: run it with "
                         "meshplan.runtime.pipeline.PipelineTrainer, one per rank")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    if comm is None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError("parallelize needs a torch.distributed world (launch with "
                               "`meshplan run` or `torchrun`) or an explicit comm=")
        comm = ProcessGroupComm(plan.mesh_shape)
    owned = {id(p) for p in model.parameters()}
    stray = [i for i, g in enumerate(optimizer.param_groups)
             if any(id(p) not in owned for p in g["params"])]
    if stray:
        raise ValueError(f"optimizer parameter group(s) {stray} hold tensors that are not "
                         "parameters of this model; give the optimizer of this model")
    return ParallelModel(model, optimizer, plan, loss_fn, comm, captured), optimizer


def _repoint(optimizer: torch.optim.Optimizer, model: nn.Module, trainer: Trainer) -> None:
    """The user's optimizer, stepping this rank's update tensors: each group keeps its
    hyper-parameters; the hooks synchronize before and refresh after every step."""
    names = {id(p): n for n, p in model.named_parameters()}
    local = {p.name: p.update for p in trainer.params}
    for group in optimizer.param_groups:
        group["params"] = [local[names[id(p)]] for p in group["params"]
                           if names[id(p)] in local]
    optimizer.state.clear()
    trainer.optimizer = optimizer

    def before(*_: Any) -> None:
        trainer.synchronize_gradients()
        total = trainer.squared_norm()
        if total is not None:
            trainer.clip(total)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(lambda *_: trainer._refresh_zero2())
