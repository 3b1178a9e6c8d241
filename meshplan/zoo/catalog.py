"""The zoo's catalogue: every model kind's spec fields with defaults, and the papers' presets.

A preset is a name for a dict of fields (``gpt:preset=39b`` means hidden=8192, layers=48, heads=64,
seq=1024, vocab=51200). Presets set model sizes only, never ``batch``, so a preset combines with any
batch (``gpt:preset=39b,batch=1024``) and any explicit field overrides the preset's value.

Defaults: ``mlp``, ``gpt``, ``moe`` and ``wresnet`` default to a tiny model (their presets give the
papers' sizes); ``bert``, ``vit`` and ``vgg19`` default to HAP's configuration (shrink them with
their size fields). Sources: ``shared/reference/perf_tables.md`` — Alpa's suites (GPT, MoE,
Wide-ResNet), Megatron-LM Table 1 (GPT at seq 2048), HAP's ``config.py`` (BERT-Base, ViT, VGG19).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

Value = int | float

# Field names in canonical order with their defaults. Immutable: read-only views of tuples.
KIND_FIELDS: Mapping[str, tuple[tuple[str, Value], ...]] = MappingProxyType({
    "mlp": (("layers", 2), ("hidden", 64), ("batch", 8), ("bias", 1)),
    "gpt": (("hidden", 64), ("layers", 2), ("heads", 4), ("seq", 32), ("vocab", 128), ("batch", 4),
            ("flash", 1)),
    "bert": (("hidden", 768), ("layers", 12), ("heads", 12), ("seq", 128), ("vocab", 30522), ("batch", 32)),
    "moe": (
        ("hidden", 32), ("layers", 2), ("heads", 4), ("experts", 4), ("seq", 16), ("vocab", 64),
        ("batch", 2), ("capacity", 2.0), ("expert_ffn", 8),
    ),
    "wresnet": (("layers", 26), ("channels", 8), ("width", 2), ("image", 32), ("classes", 10), ("batch", 4)),
    "vgg19": (("channels", 64), ("fc", 4096), ("image", 32), ("classes", 10), ("batch", 32)),
    "vit": (
        ("hidden", 768), ("layers", 12), ("heads", 12), ("patch", 4), ("image", 32), ("classes", 10),
        ("batch", 32),
    ),
})
FLAG_FIELDS = frozenset({"bias", "flash"})  # 0 or 1
# Options named in a spec's text only when they differ from their default (added after specs
# were in use: models named before keep their names).
QUIET_FIELDS = frozenset({"flash"})
FLOAT_FIELDS = frozenset({"capacity"})  # a finite float > 0; every other field is an int size >= 1
# The largest value of each size field: far past every published model (at most ~200 layers,
# hidden 25,600, a few hundred thousand vocabulary entries) yet small enough that the model
# builds on the meta device and its tensors' sizes stay within int64; beyond them a spec is a
# typo (10^9 layers would be 10^9 modules to build).
UPPER: Mapping[str, Value] = MappingProxyType({
    "layers": 4096, "hidden": 2 ** 20, "heads": 2 ** 14, "seq": 2 ** 22, "vocab": 2 ** 24,
    "batch": 2 ** 24, "experts": 2 ** 16, "expert_ffn": 2 ** 22, "capacity": 1e3,
    "channels": 2 ** 16, "width": 2 ** 10, "image": 2 ** 16, "classes": 2 ** 24, "fc": 2 ** 20,
    "patch": 2 ** 12,
})


def _table(columns: tuple[str, ...], rows: Mapping[str, tuple[int, ...]], **common: int
           ) -> Mapping[str, Mapping[str, int]]:
    return MappingProxyType({
        name: MappingProxyType({**dict(zip(columns, values, strict=True)), **common})
        for name, values in rows.items()
    })


_GPT_COLUMNS = ("hidden", "layers", "heads")
PRESETS: Mapping[str, Mapping[str, Mapping[str, int]]] = MappingProxyType({
    # Alpa's GPT-3 suite (seq 1024) and Megatron-LM Table 1 (seq 2048); vocab 51200 in both.
    "gpt": MappingProxyType({
        **_table(_GPT_COLUMNS, {
            "350m": (1024, 24, 16), "760m": (1536, 24, 16), "1.3b": (2048, 24, 32),
            "2.6b": (2560, 32, 32), "6.7b": (4096, 32, 32), "15b": (5120, 48, 40),
            "39b": (8192, 48, 64),
        }, seq=1024, vocab=51200),
        **_table(_GPT_COLUMNS, {
            "1.7b": (2304, 24, 24), "7.5b": (4096, 36, 32), "39.1b": (8192, 48, 64),
            "145.6b": (12288, 80, 96), "1t": (25600, 128, 160),
        }, seq=2048, vocab=51200),
    }),
    # Alpa's GShard MoE suite: 16 heads, seq 1024, vocab 32000, expert FFN 8h, top-2.
    "moe": _table(("hidden", "layers", "experts"), {
        "380m": (768, 8, 8), "690m": (768, 8, 16), "1.3b": (768, 16, 16), "2.4b": (1024, 16, 16),
        "10b": (1536, 16, 32), "27b": (2048, 16, 48), "70b": (2048, 32, 64),
    }, heads=16, seq=1024, vocab=32000),
    # Alpa's Wide-ResNet suite: ImageNet 224x224, 1024 classes.
    "wresnet": _table(("layers", "channels", "width"), {
        "250m": (50, 160, 2), "500m": (50, 224, 2), "1b": (50, 320, 2), "2b": (50, 448, 2),
        "4b": (50, 640, 2), "6.8b": (50, 320, 16), "13b": (101, 320, 16),
    }, image=224, classes=1024),
    # HAP's "BERT-Base": a causal LM of BERT-Base's sizes on WikiText-2 at seq 128.
    "bert": _table(("hidden", "layers", "heads"), {"base": (768, 12, 12)}, seq=128, vocab=30522),
})


def describe_presets(kind: str) -> str:
    """The preset names of ``kind`` joined by '|' (empty if it has none)."""
    return "|".join(PRESETS.get(kind, {}))


def describe_fields(kind: str) -> str:
    """``kind``'s fields with their defaults (and its presets), for error and help messages."""
    text = ", ".join(f"{name} (default {value})" for name, value in KIND_FIELDS[kind])
    presets = describe_presets(kind)
    return f"{text}; or preset={presets}" if presets else text


def describe_kinds() -> str:
    """Every kind as ``kind:field=default,...`` (with its presets), joined by '; '."""
    parts = []
    for kind, defaults in KIND_FIELDS.items():
        text = f"{kind}:" + ",".join(f"{n}={v}" for n, v in defaults)
        presets = describe_presets(kind)
        parts.append(f"{text} (presets {presets})" if presets else text)
    return "; ".join(parts)


def resolve_preset(kind: str, name: str) -> Mapping[str, int]:
    """The fields preset ``name`` (case-insensitive) stands for in ``kind``.

    Raises ValueError naming the valid presets if ``name`` is unknown or ``kind`` has none.
    """
    presets = PRESETS.get(kind)
    if not presets:
        with_presets = ", ".join(PRESETS)
        raise ValueError(f"model kind {kind!r} has no presets; kinds with presets: {with_presets}")
    key = name.strip().lower()
    if key not in presets:
        raise ValueError(f"unknown {kind} preset {name!r}; valid presets: {describe_presets(kind)}")
    return presets[key]


def check_value(kind: str, name: str, value: object) -> Value:
    """Validate field ``name`` of ``kind`` and return it normalised (float fields become float).

    Raises TypeError for a non-number (an int where one is required, bools never), ValueError for a
    flag not 0/1, a size < 1 or above `UPPER`, or a float field that is not a finite number > 0.
    """
    if name in FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{kind} field {name!r} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{kind} field {name!r} must be a finite number > 0, got {value}")
        _check_upper(kind, name, value)
        return float(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{kind} field {name!r} must be an int, got {value!r}")
    if name in FLAG_FIELDS and value not in (0, 1):
        raise ValueError(f"{kind} field {name!r} must be 0 or 1, got {value}")
    if name not in FLAG_FIELDS and value < 1:
        raise ValueError(f"{kind} field {name!r} must be >= 1, got {value}")
    _check_upper(kind, name, value)
    return value


def _check_upper(kind: str, name: str, value: Value) -> None:
    top = UPPER.get(name)
    if top is not None and value > top:
        raise ValueError(f"{kind} field {name!r} must be at most {top:,}, got {value:,} "
                         "(far past any published model: a typo?)")
