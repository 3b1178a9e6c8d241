"""Validation shared by the zoo's model configs."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def check_positive_ints(config: Any, skip: frozenset[str] = frozenset()) -> None:
    """Every dataclass field of ``config`` (but ``skip``) is an int >= 1.

    Raises TypeError naming ``Config.field`` for a non-int (bools included), ValueError for < 1.
    """
    cls = type(config).__name__
    for f in fields(config):
        if f.name in skip:
            continue
        value = getattr(config, f.name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{cls}.{f.name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{cls}.{f.name} must be >= 1, got {value}")
