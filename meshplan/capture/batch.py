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
               "or a dict of keyword arguments alone (tuples, lists and dicts may nest)")


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th batch tensor goes in a call's arguments (`BatchLayout`)."""

    index: int


@dataclass(frozen=True)
class BatchLayout:
    """How the batch's tensors, flattened in placeholder order, rebuild the model's call.

    ``args``, ``kwargs`` (key, value) and ``target`` are the call's arguments as the batch
    gave them, tuples, lists and dicts nested as they were, each tensor replaced by its
    `_Slot`; any other value (``use_cache=False``, None) stays, fixed at trace time. The
    tensors are named in order (`names`): a positional input ``input{i}``, a keyword its key,
    the target ``target``, and a tensor nested in one of these that name, a dot, and its path
    (``input0.1``, ``text.ids``, ``target.y``). ``targets``: how many of the last names are
    the target's.
    """

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    target: Any
    tensor_names: tuple[str, ...]
    targets: int

    @property
    def has_target(self) -> bool:
        return self.target is not None

    def target_names(self) -> tuple[str, ...]:
        """The names of the target's tensors."""
        return self.tensor_names[len(self.tensor_names) - self.targets:]

    def names(self) -> tuple[str, ...]:
        """Placeholder name of every batch tensor, in order."""
        return self.tensor_names

    def static(self) -> tuple[tuple[str, Any], ...]:
        """Every value of the call that is not a batch tensor, by its name (as `names`)."""
        out: list[tuple[str, Any]] = []
        for name, value in _named(self.args, self.kwargs, self.target):
            if not isinstance(value, _Slot):
                out.append((name, value))
        return tuple(out)

    def call(self, tensors: list[torch.Tensor]
             ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """``(args, kwargs, target)`` of the model call from the flattened ``tensors``."""
        def fill(value: Any) -> Any:
            return _rebuilt(value, "", lambda _, leaf: tensors[leaf.index]
                            if isinstance(leaf, _Slot) else leaf)
        return (tuple(fill(a) for a in self.args), {k: fill(v) for k, v in self.kwargs},
                fill(self.target))


def _rebuilt(value: Any, name: str, leaf: Callable[[str, Any], Any]) -> Any:
    """Nested tuples, lists and dicts as ``value`` has them, each leaf replaced by ``leaf(its
    dotted path from name, it)``. Raises TypeError for a dict key that is not a string."""
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{name} is a dict with a key {bad[0]!r}; nested dicts of a batch "
                            "must have string keys")
        return {k: _rebuilt(v, f"{name}.{k}", leaf) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuilt(v, f"{name}.{i}", leaf) for i, v in enumerate(value))
    return leaf(name, value)


def _leaves(value: Any, name: str) -> list[tuple[str, Any]]:
    """Every leaf of nested tuples, lists and dicts, by its dotted path from ``name``."""
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{name}.{k}")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{name}.{i}")]
    return [(name, value)]


def _named(args: Any, kwargs: Any, target: Any) -> list[tuple[str, Any]]:
    """The leaves of a call's positional inputs, keyword inputs and target, by name."""
    out = [leaf for i, a in enumerate(args) for leaf in _leaves(a, f"input{i}")]
    out += [leaf for k, v in kwargs for leaf in _leaves(v, k)]
    if target is not None:
        out += _leaves(target, "target")
    return out


def _parts(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"{_CONVENTION}; got a {type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def _call_parts(inputs: Any) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
    """The positional and keyword inputs of a batch's ``inputs``."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), ()
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"keyword inputs must have string keys; got {bad[0]!r}")
        return (), tuple(inputs.items())
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), ()
    raise TypeError(f"inputs are a {type(inputs).__name__}; {_CONVENTION}")


def flatten_batch(batch: Any) -> tuple[BatchLayout, dict[str, torch.Tensor]]:
    """The layout of ``batch`` and its tensors by placeholder name, in placeholder order.

    Raises TypeError naming the offending part when ``batch`` follows no valid form.
    """
    inputs, target = _parts(batch)
    args, kwargs = _call_parts(inputs)
    for name, value in _named(args, (), None):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"positional input {name.removeprefix('input')} is a "
                            f"{type(value).__name__}, not a tensor; {_CONVENTION}")
    _check_target(target)
    tensors: dict[str, torch.Tensor] = {}

    def add(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value   # fixed at trace time
        tensors[name] = value
        return _Slot(len(tensors) - 1)

    def slot(value: Any, name: str) -> Any:
        return _rebuilt(value, name, add)

    slotted_args = tuple(slot(a, f"input{i}") for i, a in enumerate(args))
    slotted_kwargs = tuple((k, slot(v, k)) for k, v in kwargs)
    if not tensors:
        raise TypeError(f"the batch holds no input tensor; {_CONVENTION}")
    num_inputs = len(tensors)
    if target is not None:
        clash = sorted(set(tensors) & {name for name, _ in _leaves(target, "target")})
        if clash:
            raise TypeError(f"a keyword input named {clash[0]!r} clashes with the batch's "
                            "target; pass the target inside the keyword dict or rename it")
    slotted_target = slot(target, "target") if target is not None else None
    targets = len(tensors) - num_inputs
    layout = BatchLayout(slotted_args, slotted_kwargs, slotted_target, tuple(tensors), targets)
    return layout, tensors


def _check_target(target: Any) -> None:
    """Raise TypeError for a target that is not None or tensors in tuples, lists and dicts
    (string keys), none of them empty."""
    if target is None or isinstance(target, torch.Tensor):
        return
    if not isinstance(target, (Mapping, tuple, list)):
        raise TypeError(f"the target is a {type(target).__name__}; {_CONVENTION}")
    kind = "dict" if isinstance(target, Mapping) else type(target).__name__
    if not target:
        raise TypeError(f"the target is a {kind} of tensors, but it is empty; {_CONVENTION}")
    for name, value in _leaves(target, "target"):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"the target is a {kind} of tensors, but entry "
                            f"{name.removeprefix('target.')!r} is a {type(value).__name__}; "
                            f"{_CONVENTION}")


def present_tensors(batch: Any, traced: BatchLayout | None) -> dict[str, torch.Tensor]:
    """A rank-local batch's tensors by name (`meshplan.data`): a rank may leave out the
    tensors it does not read — None in their place, a missing key in a dict, the whole batch
    None. Raises ValueError for a tensor the traced batch does not have."""
    if batch is None:
        return {}
    inputs, target = _parts(batch)
    args, kwargs = _call_parts(inputs)
    out = {name: v for name, v in _named(args, kwargs, target) if isinstance(v, torch.Tensor)}
    known = set(traced.names()) if traced is not None else set(out)
    if set(out) - known:
        raise ValueError(f"the batch holds tensors {sorted(set(out) - known)} the traced "
                         f"example batch does not ({sorted(known)})")
    return out


def check_static(traced: BatchLayout, given: BatchLayout) -> None:
    """Raise ValueError if ``given`` (a step's batch) does not fit the traced layout."""
    if given.names() != traced.names():
        raise ValueError(f"the batch holds tensors {list(given.names())}, the traced example "
                         f"batch {list(traced.names())}; give the same inputs at every step")
    if given.static() != traced.static():
        raise ValueError(f"non-tensor keyword inputs {dict(given.static())} differ from the "
                         f"traced ones {dict(traced.static())}; they are fixed when the plan "
                         "is made")


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
