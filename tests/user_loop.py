"""The loop PyTorch users write, shared by the parallelize, checkpoint and launcher tests: an
AdamW with Hugging Face's decay / no-decay groups and a step schedule, on one device (the
oracle) and under ``meshplan.parallelize`` on a rank."""

from __future__ import annotations

import copy
from typing import Any

import torch

import meshplan


def optimizer_for(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW without weight decay on biases and norms; the learning rate halved each step."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def one_device(w: Any, data: list) -> tuple[list[float], dict]:
    """The loop on one device: step i after ``torch.manual_seed(i)`` (the runtime's dropout)."""
    model = copy.deepcopy(w.model)
    opt, sched = optimizer_for(model)
    losses = []
    for i, ((x,), t) in enumerate(data):
        torch.manual_seed(i)
        loss = w.loss_fn(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def train_steps(model: Any, opt: torch.optim.Optimizer, sched: Any, data: list) -> list[float]:
    """The loop on a rank, with a model and optimizer from ``meshplan.parallelize`` (and a
    scheduler, or None)."""
    losses = []
    for batch in data:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def parallel(w: Any, plan: meshplan.Plan, **kw: Any) -> tuple[Any, torch.optim.Optimizer, Any]:
    """A fresh copy of the workload's model and its optimizer, parallelized under ``plan``."""
    model = copy.deepcopy(w.model)
    opt, sched = optimizer_for(model)        # made before parallelize, as users do
    model, opt = meshplan.parallelize(model, opt, plan, w.loss_fn, **kw)
    return model, opt, sched
