"""Input checks shared by the cost pass.

Argument checks raise TypeError for a wrong type and ValueError for a bad value, naming the
argument. YAML checks raise ValueError naming the source file, the key path and what was expected,
so a user can fix the file without reading code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _check_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return float(value)


def check_positive(value: object, what: str) -> float:
    """`value` as a float if it is a finite number > 0; TypeError/ValueError naming `what`."""
    number = _check_number(value, what)
    if number <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    return number


def check_nonnegative(value: object, what: str) -> float:
    """`value` as a float if it is a finite number >= 0; TypeError/ValueError naming `what`."""
    number = _check_number(value, what)
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return number


def check_count(value: object, what: str) -> int:
    """`value` if it is an int > 0 (bools rejected); TypeError/ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return value


def fail(source: str, key: str, expected: str, got: object) -> ValueError:
    """The ValueError for key path `key` of file `source`: what was expected and what was found."""
    return ValueError(f"{source}: key {key!r}: expected {expected}, got {got!r}")


def key_path(where: str, key: object) -> str:
    """Dotted path of `key` inside the mapping at path `where` ("" for the top level)."""
    return f"{where}.{key}" if where else str(key)


def check_keys(data: object, keys: tuple[str, ...], source: str, where: str,
               optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """`data` if it is a mapping with every one of `keys` and nothing but them and `optional`;
    ValueError naming a missing or unknown key."""
    if not isinstance(data, Mapping):
        raise fail(source, where or "<top level>", f"a mapping with keys {list(keys)}", data)
    for key in data:
        if key not in keys and key not in optional:
            valid = list(keys) + [f"{k} (optional)" for k in optional]
            raise ValueError(f"{source}: unknown key {key_path(where, key)!r}; valid keys: {valid}")
    for key in keys:
        if key not in data:
            raise ValueError(f"{source}: missing key {key_path(where, key)!r} (required: {list(keys)})")
    return data


def number(data: Mapping[str, Any], key: str, source: str, where: str, allow_zero: bool = False) -> float:
    """`data[key]` as a float if it is a finite number > 0 (≥ 0 with `allow_zero`); else ValueError."""
    value, path = data[key], key_path(where, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(source, path, "a number", value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise fail(source, path, "a finite number >= 0" if allow_zero else "a finite number > 0", value)
    return float(value)


def positive_int(data: Mapping[str, Any], key: str, source: str, where: str = "") -> int:
    """`data[key]` if it is an int > 0 (bools rejected); else ValueError."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(source, key_path(where, key), "an integer > 0", value)
    return value
