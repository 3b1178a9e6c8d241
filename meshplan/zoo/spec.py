"""Model specs: the MODEL argument of the CLI, turned into a model, a loss and an example batch.

Two forms are accepted by :func:`build_workload`:
  * a zoo spec ``kind:field=int,field=int`` — e.g. ``mlp:layers=6,hidden=256,batch=32,bias=1`` or
    ``gpt:hidden=768,layers=12,heads=12,seq=1024,vocab=51200,batch=8``; omitted fields take the
    kind's defaults (see ``_KIND_FIELDS``);
  * a user file ``path/to/file.py:fn`` whose ``fn()`` returns ``(model, loss_fn, example_batch)``.

Every field is an integer today; named presets (``gpt:preset=1.3b``) will be expanded into
fields inside :func:`parse_model_spec` before the integer parse, leaving ModelSpec unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor, nn

from meshplan.zoo import gpt, mlp
from meshplan.zoo.user_file import is_file_spec, load_model_file

# Field names in canonical order with their defaults. Immutable: a read-only view of tuples.
_KIND_FIELDS = MappingProxyType({
    "mlp": (("layers", 2), ("hidden", 64), ("batch", 8), ("bias", 1)),
    "gpt": (("hidden", 64), ("layers", 2), ("heads", 4), ("seq", 32), ("vocab", 128), ("batch", 4)),
})
_FLAG_FIELDS = frozenset({"bias"})  # 0 or 1; every other field is a size >= 1
_DEVICES = ("meta", "cpu")

Batch = tuple[tuple[Tensor, ...], Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


def _describe_fields(kind: str) -> str:
    return ", ".join(f"{name} (default {value})" for name, value in _KIND_FIELDS[kind])


def _describe_kinds() -> str:
    return "; ".join(
        f"{kind}:" + ",".join(f"{n}={v}" for n, v in defaults) for kind, defaults in _KIND_FIELDS.items()
    )


def _check_value(kind: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{kind} field {name!r} must be an int, got {value!r}")
    if name in _FLAG_FIELDS and value not in (0, 1):
        raise ValueError(f"{kind} field {name!r} must be 0 or 1, got {value}")
    if name not in _FLAG_FIELDS and value < 1:
        raise ValueError(f"{kind} field {name!r} must be >= 1, got {value}")


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model: its ``kind`` and integer ``fields`` as (name, value) pairs.

    Normalised on construction: omitted fields get their defaults and all fields are put in the
    kind's canonical order, so equal models compare (and hash) equal. ``str(spec)`` is the full
    spec text, which :func:`parse_model_spec` reads back to an equal spec.
    Raises ValueError for an unknown kind, an unknown or repeated field, or a value out of range;
    TypeError for a non-int value.
    """

    kind: str
    fields: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KIND_FIELDS:
            raise ValueError(f"unknown model kind {self.kind!r}; valid kinds: {_describe_kinds()}")
        given: dict[str, int] = {}
        for name, value in self.fields:
            if name not in dict(_KIND_FIELDS[self.kind]):
                raise ValueError(
                    f"unknown field {name!r} for model kind {self.kind!r}; "
                    f"valid fields: {_describe_fields(self.kind)}"
                )
            if name in given:
                raise ValueError(f"field {name!r} given twice for model kind {self.kind!r}")
            _check_value(self.kind, name, value)
            given[name] = value
        full = tuple((name, given.get(name, default)) for name, default in _KIND_FIELDS[self.kind])
        object.__setattr__(self, "fields", full)  # frozen: normalise once, at construction

    def get(self, name: str) -> int:
        """Value of field ``name``. Raises ValueError naming the valid fields if it is unknown."""
        for field_name, value in self.fields:
            if field_name == name:
                return value
        raise ValueError(
            f"unknown field {name!r} for model kind {self.kind!r}; valid fields: {_describe_fields(self.kind)}"
        )

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{name}={value}" for name, value in self.fields)


def _parse_field(kind: str, item: str, text: str) -> tuple[str, int]:
    name, eq, raw = item.partition("=")
    name, raw = name.strip(), raw.strip()
    if not eq:
        raise ValueError(
            f"field {item.strip()!r} in model spec {text!r} has no '='; write name=value with a name "
            f"among: {_describe_fields(kind)}"
        )
    if name not in dict(_KIND_FIELDS[kind]):
        raise ValueError(
            f"unknown field {name!r} in model spec {text!r}; valid fields for {kind}: {_describe_fields(kind)}"
        )
    try:
        return name, int(raw)
    except ValueError:
        raise ValueError(f"field {name!r} in model spec {text!r} must be an integer, got {raw!r}") from None


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``kind[:name=int,...]`` (e.g. ``mlp:layers=6,hidden=256``) into a full ModelSpec.

    Raises TypeError if ``text`` is not a str; ValueError naming the bad part and listing the valid
    kinds or fields with their defaults for an unknown kind, an unknown or repeated field, a
    missing '=', a non-integer value or a value out of range.
    """
    if not isinstance(text, str):
        raise TypeError(f"model spec must be a str, got {type(text).__name__}")
    kind, _, body = text.strip().partition(":")
    kind = kind.strip()
    if kind not in _KIND_FIELDS:
        raise ValueError(
            f"unknown model kind {kind!r} in {text!r}; valid kinds (with defaults): {_describe_kinds()}; "
            f"or a model file 'path/to/file.py:fn'"
        )
    items = body.split(",") if body.strip() else []
    return ModelSpec(kind, tuple(_parse_field(kind, item, text) for item in items))


@dataclass(frozen=True, eq=False)
class Workload:
    """What meshplan plans: ``loss_fn(model(*example_batch[0]), example_batch[1])`` is the loss.

    ``name`` is the canonical spec text for zoo models and ``path.py:fn`` for file models.
    Compared by identity (eq=False): comparing modules by value is neither cheap nor meaningful.
    """

    model: nn.Module
    loss_fn: LossFn
    example_batch: Batch
    name: str


def _build_mlp(spec: ModelSpec, device: str, generator: torch.Generator) -> tuple[nn.Module, LossFn, Batch]:
    model = mlp.MLP(spec.get("hidden"), spec.get("layers"), bias=bool(spec.get("bias")))
    batch = mlp.make_example_batch(spec.get("batch"), spec.get("hidden"), device=device, generator=generator)
    return model, mlp.mlp_loss, batch


def _build_gpt(spec: ModelSpec, device: str, generator: torch.Generator) -> tuple[nn.Module, LossFn, Batch]:
    config = gpt.GPTConfig(
        hidden=spec.get("hidden"),
        num_layers=spec.get("layers"),
        num_heads=spec.get("heads"),
        seq_len=spec.get("seq"),
        vocab_size=spec.get("vocab"),
    )
    batch = gpt.make_example_batch(config, spec.get("batch"), device=device, generator=generator)
    return gpt.GPT(config), gpt.gpt_loss, batch


_BUILDERS = MappingProxyType({"mlp": _build_mlp, "gpt": _build_gpt})


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
            model, loss_fn, batch = _BUILDERS[spec.kind](spec, device, generator)
    return Workload(model=model, loss_fn=loss_fn, example_batch=batch, name=str(spec))


def _check_device_and_seed(device: object, seed: object) -> None:
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def build_workload(text: str, *, device: str = "meta", seed: int = 0) -> Workload:
    """Build the Workload named by ``text``: a zoo spec or ``path/to/file.py:fn``.

    Zoo specs: see :func:`build_zoo_workload`. File models: ``fn()`` is called with ``device`` as the
    default device and the global RNG seeded with ``seed`` inside ``fork_rng``; it must return
    ``(model, loss_fn, (inputs, target))`` with ``inputs`` a tuple of tensors.
    Raises TypeError for a non-str ``text``; ValueError for a bad spec, device or seed, a missing
    file or function, or a function returning the wrong structure.
    """
    if not isinstance(text, str):
        raise TypeError(f"model spec must be a str, got {type(text).__name__}")
    if is_file_spec(text, zoo_kinds=tuple(_KIND_FIELDS)):
        _check_device_and_seed(device, seed)
        model, loss_fn, batch = load_model_file(text, device=device, seed=seed)
        return Workload(model=model, loss_fn=loss_fn, example_batch=batch, name=text.strip())
    return build_zoo_workload(parse_model_spec(text), device=device, seed=seed)
