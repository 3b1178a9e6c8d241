"""What a batch is, and what the loss of one step is, as people write them.

One convention for ``example_batch`` (tracing) and ``Trainer.step(batch)`` (running):

* ``(inputs, target)``: ``inputs`` is one tensor, a tuple/list of tensors (positional
  arguments of ``model``) or a dict of keyword arguments; ``target`` is a tensor, a tuple/list
  of tensors or a dict of them (passed to ``loss_fn(output, target)`` in that form: a loss of
  several heads) or None (``loss_fn(output)``, or the model's own loss);
* a dict of keyword arguments alone, e.g. ``{"input_ids": ids, "attention_mask": mask,
  "labels": labels}``: the same as ``(that_dict, None)``.

Every tensor's dim 0 is the batch. Non-tensor keyword values (``use_cache=False``, None) are
fixed at trace time: a step's batch must repeat them unchanged. With ``loss_fn=None`` the model
returns its loss: a scalar tensor, a ``loss`` entry/attribute (``transformers``'
``ModelOutput``, a dict) or, for a tuple, a scalar first element (``return_dict=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

_CONVENTION = ("a batch is (inputs, target) with inputs a tensor, a tuple of tensors or a dict "
               "of keyword arguments and target a tensor, a tuple or dict of tensors, or None; "
               "or a dict of keyword arguments alone")

# The forms a target may take, as `BatchLayout.target_kind` names them.
_TARGET_KINDS = {torch.Tensor: "tensor", tuple: "tuple", list: "list"}


@dataclass(frozen=True)
class BatchLayout:
    """How the batch's tensors, flattened in placeholder order, rebuild the model's call.

    Tensors come as ``positional`` inputs (named ``input{i}``), then the ``keywords`` (named by
    their key), then the target's (`target_names`). ``static`` holds the non-tensor keyword
    arguments, fixed at trace time. ``target_kind``: None (no target), "tensor", "tuple",
    "list" or "dict", whose ``target_keys`` (a dict's keys, a sequence's indices) name its
    tensors.
    """

    positional: int
    keywords: tuple[str, ...]
    static: tuple[tuple[str, Any], ...]
    target_kind: str | None = None
    target_keys: tuple[str, ...] = ()

    @property
    def has_target(self) -> bool:
        return self.target_kind is not None

    def target_names(self) -> tuple[str, ...]:
        """The target's tensors' names: ``target``, or ``target.KEY`` for each of a dict's
        keys or a sequence's indices."""
        if self.target_kind == "tensor":
            return ("target",)
        return tuple(f"target.{k}" for k in self.target_keys)

    def names(self) -> tuple[str, ...]:
        """Placeholder name of every batch tensor, in order."""
        return (tuple(f"input{i}" for i in range(self.positional)) + self.keywords
                + self.target_names())

    def call(self, tensors: list[torch.Tensor]
             ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], Any]:
        """``(args, kwargs, target)`` of the model call from the flattened ``tensors``."""
        args = tuple(tensors[:self.positional])
        k = self.positional + len(self.keywords)
        kwargs = dict(zip(self.keywords, tensors[self.positional:k])) | dict(self.static)
        rest = tensors[k:]
        if self.target_kind is None:
            return args, kwargs, None
        if self.target_kind == "tensor":
            return args, kwargs, rest[0]
        if self.target_kind == "dict":
            return args, kwargs, dict(zip(self.target_keys, rest))
        return args, kwargs, (tuple if self.target_kind == "tuple" else list)(rest)


def _parts(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"{_CONVENTION}; got a {type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def flatten_batch(batch: Any) -> tuple[BatchLayout, dict[str, torch.Tensor]]:
    """The layout of ``batch`` and its tensors by placeholder name, in placeholder order.

    Raises TypeError naming the offending part when ``batch`` follows no valid form.
    """
    inputs, target = _parts(batch)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"keyword inputs must have string keys; got {bad[0]!r}")
        positional: tuple = ()
        keywords = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        static = tuple((k, v) for k, v in inputs.items() if not isinstance(v, torch.Tensor))
    elif isinstance(inputs, (tuple, list)):
        positional, keywords, static = tuple(inputs), {}, ()
        bad = [i for i, t in enumerate(positional) if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"positional input {bad[0]} is a {type(positional[bad[0]]).__name__}, "
                            f"not a tensor; {_CONVENTION}")
    else:
        raise TypeError(f"inputs are a {type(inputs).__name__}; {_CONVENTION}")
    kind, keys, targets = _target_parts(target)
    if not positional and not keywords:
        raise TypeError(f"the batch holds no input tensor; {_CONVENTION}")
    layout = BatchLayout(len(positional), tuple(keywords), static, kind, keys)
    clash = sorted(set(keywords) & set(layout.target_names()))
    if clash:
        raise TypeError(f"a keyword input named {clash[0]!r} clashes with the batch's target; "
                        "pass the target inside the keyword dict or rename it")
    tensors = list(positional) + list(keywords.values()) + targets
    return layout, dict(zip(layout.names(), tensors))


def _target_parts(target: Any) -> tuple[str | None, tuple[str, ...], list[torch.Tensor]]:
    """The target's kind, keys and tensors (`BatchLayout`). Raises TypeError for a target of
    another form, or one whose entries are not all tensors."""
    if target is None:
        return None, (), []
    if isinstance(target, torch.Tensor):
        return "tensor", (), [target]
    if isinstance(target, Mapping):
        keys = list(target)
        values = list(target.values())
        kind = "dict"
        bad_key = [k for k in keys if not isinstance(k, str)]
        if bad_key:
            raise TypeError(f"a target dict must have string keys; got {bad_key[0]!r}")
    elif type(target) in _TARGET_KINDS:
        keys, values, kind = [str(i) for i in range(len(target))], list(target), \
            _TARGET_KINDS[type(target)]
    else:
        raise TypeError(f"the target is a {type(target).__name__}; {_CONVENTION}")
    bad = [k for k, v in zip(keys, values) if not isinstance(v, torch.Tensor)]
    if bad or not values:
        what = f"entry {bad[0]!r} is a {type(values[keys.index(bad[0])]).__name__}" if bad \
            else "it is empty"
        raise TypeError(f"the target is a {kind} of tensors, but {what}; {_CONVENTION}")
    return kind, tuple(keys), values


def present_tensors(batch: Any, traced: BatchLayout | None) -> dict[str, torch.Tensor]:
    """A rank-local batch's tensors by name (`meshplan.data`): a rank may leave out the
    tensors it does not read — None in their place, a missing key in a dict, the whole batch
    None. Raises ValueError for a tensor the traced batch does not have."""
    if batch is None:
        return {}
    inputs, target = _parts(batch)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, Mapping):
        out = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    elif isinstance(inputs, (tuple, list)):
        out = {f"input{i}": v for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)}
    else:
        raise TypeError(f"inputs are a {type(inputs).__name__}; {_CONVENTION}")
    out |= _present_targets(target)
    known = set(traced.names()) if traced is not None else set(out)
    if set(out) - known:
        raise ValueError(f"the batch holds tensors {sorted(set(out) - known)} the traced "
                         f"example batch does not ({sorted(known)})")
    return out


def _present_targets(target: Any) -> dict[str, torch.Tensor]:
    """The tensors of a rank-local batch's target by name; entries left out (None) skipped."""
    if isinstance(target, torch.Tensor):
        return {"target": target}
    if isinstance(target, Mapping):
        items = list(target.items())
    elif isinstance(target, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(target)]
    else:
        return {}
    return {f"target.{k}": v for k, v in items if isinstance(v, torch.Tensor)}


def check_static(traced: BatchLayout, given: BatchLayout) -> None:
    """Raise ValueError if ``given`` (a step's batch) does not fit the traced layout."""
    if given.names() != traced.names():
        raise ValueError(f"the batch holds tensors {list(given.names())}, the traced example "
                         f"batch {list(traced.names())}; give the same inputs at every step")
    if given.static != traced.static:
        raise ValueError(f"non-tensor keyword inputs {dict(given.static)} differ from the traced "
                         f"ones {dict(traced.static)}; they are fixed when the plan is made")


def batch_shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    """Each batch tensor's shape by placeholder name."""
    return {k: tuple(v.shape) for k, v in flatten_batch(batch)[1].items()}


def check_shapes(planned: Mapping[str, tuple[int, ...]], batch: Any) -> None:
    """Raise ValueError unless ``batch``'s tensors have the ``planned`` shapes. Every rank is
    handed the same global batch, so every rank refuses it alike, before communicating."""
    given = batch_shapes(batch)
    if given == dict(planned) or set(given) != set(planned):
        return   # other tensors: `check_static` names them
    diff = {k: (planned.get(k), given.get(k)) for k in {*planned, *given}
            if planned.get(k) != given.get(k)}
    shown = ", ".join(f"{k}: planned {list(a) if a is not None else None}, "
                      f"given {list(b) if b is not None else None}" for k, (a, b) in
                      sorted(diff.items()))
    raise ValueError(f"this batch's shapes differ from the ones the plan was made for ({shown}); "
                     "a plan runs the batch shape of its example batch: pad or cut the batch "
                     "to that shape (the planned batch size and sequence length), or make a "
                     "plan with an example batch of this shape")


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model returned itself (``loss_fn=None``). Raises ValueError if there is none."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
            and out[0].dim() == 0:
        return out[0]
    raise ValueError(f"loss_fn is None, so the model must return its loss (a scalar tensor, a "
                     f"'loss' entry or attribute, or a tuple starting with it); it returned a "
                     f"{type(out).__name__} without one (a transformers model computes it when "
                     f"given labels=...), or pass a loss_fn")


def step_loss(loss_fn: Callable | None, out: Any, target: Any) -> Any:
    """The loss of one step: ``loss_fn(out, target)``, ``loss_fn(out)`` or the model's own."""
    if loss_fn is None:
        if target is not None:
            raise ValueError("the batch has a target but loss_fn is None; give a "
                             "loss_fn(output, target), or a batch without target (a dict of "
                             "keyword arguments) for a model that returns its loss")
        return model_loss(out)
    return loss_fn(out) if target is None else loss_fn(out, target)


def whole_loss(model: Any, loss_fn: Callable | None, batch: Any,
               device: torch.device | None = None) -> Any:
    """``model`` run on ``batch`` (its tensors moved to ``device``) and the step's loss, as one
    device computes it."""
    layout, tensors = flatten_batch(batch)
    moved = [t.to(device) if device is not None else t for t in tensors.values()]
    args, kwargs, target = layout.call(moved)
    return step_loss(loss_fn, model(*args, **kwargs), target)


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every tensor of ``batch``. Raises ValueError if they differ
    (every tensor's dim 0 is the batch) and TypeError for a malformed batch."""
    _, tensors = flatten_batch(batch)
    sizes = {name: t.shape[0] for name, t in tensors.items() if t.dim()}
    distinct = set(sizes.values())
    if len(distinct) != 1:
        raise ValueError(f"every batch tensor's dim 0 is the batch, but their sizes differ "
                         f"(or no tensor has a dim): {sizes}")
    return distinct.pop()


def split_microbatches(batch: Any, num: int) -> list[Any]:
    """``batch`` cut along dim 0 into ``num`` equal micro-batches of the same form.

    Raises ValueError if ``num`` does not divide the batch size (naming the valid counts).
    A 0-dim tensor (a scalar target) goes whole into every micro-batch."""
    if num == 1:
        return [batch]
    size = batch_size(batch)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1 or size % num:
        valid = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"{num!r} micro-batches do not divide the batch of {size}; valid "
                         f"counts: {valid}")
    return [_piece(batch, num, i) for i in range(num)]


def _piece(x: Any, num: int, i: int) -> Any:
    if isinstance(x, torch.Tensor):
        if not x.dim():
            return x
        size = x.shape[0] // num  # one view, not all num chunks per piece (num² views)
        return x.narrow(0, i * size, size)
    if isinstance(x, Mapping):
        return {k: _piece(v, num, i) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_piece(v, num, i) for v in x)
    return x
