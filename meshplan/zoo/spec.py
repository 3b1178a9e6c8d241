"""Model specs: the MODEL argument of the CLI, turned into a model, a loss and an example batch.

Two forms are accepted by :func:`build_workload`:
  * a zoo spec ``kind:field=value,...`` — e.g. ``mlp:layers=6,hidden=256,batch=32,bias=1``,
    ``gpt:hidden=768,layers=12,heads=12,seq=1024,vocab=51200,batch=8`` or, with a named preset,
    ``gpt:preset=39b,batch=1024``; omitted fields take the kind's defaults and explicit fields
    override the preset's (kinds, fields, defaults and presets: :mod:`meshplan.zoo.catalog`);
  * a user file ``path/to/file.py:fn`` whose ``fn()`` returns ``(model, loss_fn, example_batch)``.

Every field is an int except ``moe``'s capacity factor (a float). A preset is expanded into
fields by :func:`parse_model_spec`, so a ModelSpec holds fields only and prints without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from meshplan.zoo.builders import BUILDERS, Batch, LossFn
from meshplan.zoo.catalog import (KIND_FIELDS, QUIET_FIELDS, Value, check_value, describe_fields,
                                  describe_kinds, resolve_preset)
from meshplan.zoo.user_file import is_file_spec, load_model_file

_DEVICES = ("meta", "cpu")


def describe_zoo() -> str:
    """Every zoo kind with its fields' defaults and presets, for CLI help and error messages."""
    return describe_kinds()


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model: its ``kind`` and ``fields`` as (name, value) pairs (ints; floats where the
    catalogue says so, e.g. ``moe``'s ``capacity``).

    Normalised on construction: omitted fields get their defaults, float fields become floats and
    all fields are put in the kind's canonical order, so equal models compare (and hash) equal.
    ``str(spec)`` is the full spec text, which :func:`parse_model_spec` reads back to an equal spec.
    Raises ValueError for an unknown kind, an unknown or repeated field, or a value out of range;
    TypeError for a value of the wrong type.
    """

    kind: str
    fields: tuple[tuple[str, Value], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KIND_FIELDS:
            raise ValueError(f"unknown model kind {self.kind!r}; valid kinds: {describe_kinds()}")
        given: dict[str, Value] = {}
        for name, value in self.fields:
            if name not in dict(KIND_FIELDS[self.kind]):
                raise ValueError(
                    f"unknown field {name!r} for model kind {self.kind!r}; "
                    f"valid fields: {describe_fields(self.kind)}"
                )
            if name in given:
                raise ValueError(f"field {name!r} given twice for model kind {self.kind!r}")
            given[name] = check_value(self.kind, name, value)
        full = tuple((name, given.get(name, default)) for name, default in KIND_FIELDS[self.kind])
        object.__setattr__(self, "fields", full)  # frozen: normalise once, at construction

    def get(self, name: str) -> Value:
        """Value of field ``name``. Raises ValueError naming the valid fields if it is unknown."""
        for field_name, value in self.fields:
            if field_name == name:
                return value
        raise ValueError(
            f"unknown field {name!r} for model kind {self.kind!r}; valid fields: {describe_fields(self.kind)}"
        )

    def as_dict(self) -> Mapping[str, Value]:
        """Every field by name (a fresh dict)."""
        return dict(self.fields)

    def __str__(self) -> str:
        defaults = dict(KIND_FIELDS[self.kind])
        return f"{self.kind}:" + ",".join(f"{name}={value}" for name, value in self.fields
                                          if name not in QUIET_FIELDS or value != defaults[name])


def _split_item(kind: str, item: str, text: str) -> tuple[str, str]:
    name, eq, raw = item.partition("=")
    name, raw = name.strip(), raw.strip()
    if not eq:
        raise ValueError(
            f"field {item.strip()!r} in model spec {text!r} has no '='; write name=value with a name "
            f"among: {describe_fields(kind)}"
        )
    if name != "preset" and name not in dict(KIND_FIELDS[kind]):
        raise ValueError(
            f"unknown field {name!r} in model spec {text!r}; valid fields for {kind}: {describe_fields(kind)}"
        )
    return name, raw


def _parse_value(kind: str, name: str, raw: str, text: str) -> Value:
    number_type = float if isinstance(dict(KIND_FIELDS[kind])[name], float) else int
    try:
        return number_type(raw)
    except ValueError:
        wanted = "a number" if number_type is float else "an integer"
        raise ValueError(f"field {name!r} in model spec {text!r} must be {wanted}, got {raw!r}") from None


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``kind[:name=value,...]`` (e.g. ``mlp:layers=6,hidden=256`` or
    ``gpt:preset=39b,batch=1024``) into a full ModelSpec.

    ``preset=NAME`` (at most once, anywhere in the list) sets the preset's fields; explicit fields
    override them. Raises TypeError if ``text`` is not a str; ValueError naming the bad part and
    listing the valid kinds, fields (with defaults) or presets for an unknown kind, field or
    preset, a repeated field or preset, a missing '=', a non-numeric value or a value out of range.
    """
    if not isinstance(text, str):
        raise TypeError(f"model spec must be a str, got {type(text).__name__}")
    kind, _, body = text.strip().partition(":")
    kind = kind.strip()
    if kind not in KIND_FIELDS:
        raise ValueError(
            f"unknown model kind {kind!r} in {text!r}; valid kinds (with defaults): {describe_kinds()}; "
            f"or a model file 'path/to/file.py:fn'"
        )
    items = [_split_item(kind, item, text) for item in body.split(",")] if body.strip() else []
    presets = [raw for name, raw in items if name == "preset"]
    if len(presets) > 1:
        raise ValueError(f"preset given {len(presets)} times in model spec {text!r}; give at most one")
    explicit: dict[str, Value] = {}
    for name, raw in items:
        if name in explicit:
            raise ValueError(f"field {name!r} given twice in model spec {text!r}")
        if name != "preset":
            explicit[name] = _parse_value(kind, name, raw, text)
    fields = {**(resolve_preset(kind, presets[0]) if presets else {}), **explicit}
    return ModelSpec(kind, tuple(fields.items()))


@dataclass(frozen=True, eq=False)
class Workload:
    """What meshplan plans: the loss of ``model`` on ``example_batch`` (``(inputs, target)`` or a
    dict of keyword arguments; ``loss_fn`` None when the model returns its loss, see
    ``capture/batch.py``).

    ``name`` is the canonical spec text for zoo models and ``path.py:fn`` for file models.
    Compared by identity (eq=False): comparing modules by value is neither cheap nor meaningful.
    """

    model: nn.Module
    loss_fn: LossFn
    example_batch: Batch
    name: str


def build_zoo_workload(spec: ModelSpec, *, device: str = "meta", seed: int = 0) -> Workload:
    """Build the zoo model ``spec`` on ``device`` ("meta" or "cpu") with its loss and example batch.

    On "meta" nothing is allocated. On "cpu" parameters come from ``torch.manual_seed(seed)`` inside
    ``fork_rng`` (the caller's global RNG state is untouched) and the batch from a Generator seeded
    with ``seed``: the same seed gives bit-identical parameters and batch.
    Raises ValueError for an unknown device, a negative seed, or inconsistent sizes (e.g. gpt hidden
    not divisible by heads); TypeError for a non-int seed.
    """
    _check_device_and_seed(device, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model, loss_fn, batch = BUILDERS[spec.kind](spec.as_dict(), device, generator)
    return Workload(model=model, loss_fn=loss_fn, example_batch=batch, name=str(spec))


def _check_device_and_seed(device: object, seed: object) -> None:
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def build_workload(text: str, *, device: str = "meta", seed: int = 0) -> Workload:
    """Build the Workload named by ``text``: a zoo spec, ``path/to/file.py:fn`` or a Hugging
    Face model, ``hf:NAME[,field=value...]`` or ``hf:path/config.json`` (`hf_catalog.py`).

    Zoo specs: see :func:`build_zoo_workload`. File models: ``fn()`` is called with ``device`` as the
    default device and the global RNG seeded with ``seed`` inside ``fork_rng``; it must return
    ``(model, loss_fn, example_batch)``: ``example_batch`` is ``(inputs, target)`` (inputs a tensor,
    a tuple of tensors or a dict of keyword arguments) or a dict of keyword arguments, with
    ``loss_fn`` None for a model returning its own loss.
    Raises TypeError for a non-str ``text``; ValueError for a bad spec, device or seed, a missing
    file or function, or a function returning the wrong structure.
    """
    if not isinstance(text, str):
        raise TypeError(f"model spec must be a str, got {type(text).__name__}")
    if text.strip().startswith("hf:"):   # a Hugging Face model by name or config.json
        from meshplan.zoo.hf_catalog import hf_workload
        _check_device_and_seed(device, seed)
        return hf_workload(text, device=device, seed=seed)
    if is_file_spec(text, zoo_kinds=tuple(KIND_FIELDS)):
        _check_device_and_seed(device, seed)
        model, loss_fn, batch = load_model_file(text, device=device, seed=seed)
        return Workload(model=model, loss_fn=loss_fn, example_batch=batch, name=text.strip())
    return build_zoo_workload(parse_model_spec(text), device=device, seed=seed)
