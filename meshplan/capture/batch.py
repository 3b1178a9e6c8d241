"""The batch a user hands meshplan, in the forms people write, and the loss it leads to.

Two forms, for the example batch of `meshplan.api.plan` and every `Trainer.step`:

- ``(inputs, target)``: ``inputs`` a tensor or a tuple of tensors passed positionally to the
  model, ``target`` a tensor; the loss is ``loss_fn(model(*inputs), target)``.
- a dict of keyword arguments (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``):
  the model is called as ``model(**batch)``; the loss is ``loss_fn(output, batch)`` or, with
  ``loss_fn=None``, the loss the model returns itself (``output.loss``, ``output["loss"]`` or
  the first element of a tuple: Hugging Face's ``labels=`` loss). Entries that are not tensors
  (``use_cache=False``) are fixed at trace time.

Every tensor of a batch has the batch on dim 0; meshplan splits it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Which form a batch has and the names of its tensors, in the order they are traced
    (``input0``…, ``target`` for a pair; the dict's keys for keyword arguments)."""

    kind: str                      # "pair" or "kwargs"
    names: tuple[str, ...]
    fixed: tuple[tuple[str, Any], ...] = ()   # non-tensor keyword arguments

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        """The batch again, from its tensors in trace order."""
        if self.kind == "pair":
            return tuple(tensors[:-1]), tensors[-1]
        return {**dict(zip(self.names, tensors)), **dict(self.fixed)}


def batch_layout(batch: Any) -> BatchLayout:
    """The layout of a batch; TypeError naming what is wrong and the valid forms."""
    if isinstance(batch, dict):
        names = tuple(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        if not names:
            raise TypeError("a keyword-argument batch needs at least one tensor, e.g. "
                            "{'input_ids': ids, 'labels': labels}")
        if not all(isinstance(k, str) for k in batch):
            raise TypeError(f"batch keys must be argument names (str); got {list(batch)}")
        fixed = tuple((k, v) for k, v in batch.items() if not isinstance(v, torch.Tensor))
        return BatchLayout("kwargs", names, fixed)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, target = batch
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
        if (isinstance(inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in inputs)
                and isinstance(target, torch.Tensor)):
            return BatchLayout("pair", tuple(f"input{i}" for i in range(len(inputs)))
                               + ("target",))
    raise TypeError("a batch is (inputs, target) with inputs a tensor or a tuple of tensors and "
                    "target a tensor, or a dict of keyword arguments for the model such as "
                    f"{{'input_ids': ids, 'labels': labels}}; got {type(batch).__name__}")


def batch_tensors(batch: Any, layout: BatchLayout | None = None) -> dict[str, torch.Tensor]:
    """The batch's tensors by name. With ``layout`` (the example batch's), ValueError when this
    batch has another form or other tensors."""
    mine = batch_layout(batch)
    if layout is not None and (mine.kind, mine.names) != (layout.kind, layout.names):
        raise ValueError(f"this batch has tensors {list(mine.names)} ({mine.kind}); the plan was "
                         f"made for {list(layout.names)} ({layout.kind})")
    if mine.kind == "pair":
        inputs, target = batch
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return {**{f"input{i}": t for i, t in enumerate(inputs)}, "target": target}
    return {k: batch[k] for k in mine.names}


def model_loss(output: Any) -> Any:
    """The loss a model returned itself; ValueError when its output carries none."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("loss_fn is None, so the model must return its loss (output.loss, "
                         "output['loss'] or a tuple starting with it, e.g. a Hugging Face model "
                         "given labels=); it returned "
                         f"{type(output).__name__}. Pass labels in the batch or give a loss_fn")
    return loss


def forward_loss(model: Callable, loss_fn: Callable | None, layout: BatchLayout,
                 tensors: list[torch.Tensor]) -> Any:
    """The loss of one batch given as its tensors in trace order (see the module docstring)."""
    batch = layout.rebuild(tensors)
    if layout.kind == "pair":
        inputs, target = batch
        out = model(*inputs)
        return loss_fn(out, target) if loss_fn is not None else model_loss(out)
    out = model(**batch)
    return loss_fn(out, batch) if loss_fn is not None else model_loss(out)
