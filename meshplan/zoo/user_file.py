"""Load a user's model from ``path/to/file.py:fn``, where ``fn()`` returns the workload parts.

The file is imported under a private module name that is registered in ``sys.modules`` only while
the file executes (dataclasses and typing resolve annotations through it), then removed, so loading
a file named ``model.py`` never shadows or clobbers an importable ``model`` module. The file's own
directory is not put on ``sys.path``: sibling imports must be importable already.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from meshplan.capture.batch import flatten_batch

Parts = tuple[nn.Module, "Callable[..., Tensor] | None", Any]

_EXPECTED = ("(model: nn.Module, loss_fn: callable or None, example_batch) with example_batch "
             "(inputs, target) - inputs a Tensor, a tuple of Tensors or a dict of keyword "
             "arguments, target a Tensor or None - or a dict of keyword arguments alone; "
             "loss_fn None when the model returns its loss")


def is_file_spec(text: str, *, zoo_kinds: tuple[str, ...]) -> bool:
    """True if ``text`` names a Python file (``x.py`` or ``x.py:fn``) rather than a zoo kind."""
    stripped = text.strip()
    if stripped.partition(":")[0].strip() in zoo_kinds:
        return False
    return stripped.endswith(".py") or stripped.rpartition(":")[0].strip().endswith(".py")


def split_file_spec(text: str) -> tuple[Path, str]:
    """Split ``path/to/file.py:fn`` into the path and the function name.

    Raises ValueError if the ``:fn`` part is missing, is not an identifier, or the path does not
    end in ``.py``.
    """
    path_text, sep, fn_name = text.strip().rpartition(":")
    if not sep or not path_text.strip().endswith(".py"):
        raise ValueError(f"model file spec {text!r} must be 'path/to/file.py:fn' naming the function to call")
    fn_name = fn_name.strip()
    if not fn_name.isidentifier():
        raise ValueError(f"function name {fn_name!r} in model file spec {text!r} is not a Python identifier")
    return Path(path_text.strip()), fn_name


def _import_file(path: Path) -> ModuleType:
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"_meshplan_user_model_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"cannot import model file {str(path)!r} as Python source")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _check_result(result: object, where: str) -> Parts:
    def fail(problem: str) -> ValueError:
        return ValueError(f"{where} returned {problem}; expected {_EXPECTED}")

    if not isinstance(result, (tuple, list)):
        raise fail(f"a {type(result).__name__}")
    if len(result) != 3:
        raise fail(f"a {type(result).__name__} of length {len(result)}")
    model, loss_fn, batch = result
    if not isinstance(model, nn.Module):
        raise fail(f"a model of type {type(model).__name__}, not an nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise fail(f"a loss_fn of type {type(loss_fn).__name__}, which is not callable")
    try:
        layout, _ = flatten_batch(batch)
    except TypeError as exc:
        raise fail(f"an example_batch that does not fit ({exc})") from None
    if loss_fn is None and layout.has_target:
        raise fail("a target but no loss_fn (a model returning its loss takes a batch without "
                   "target, e.g. a dict of keyword arguments)")
    if isinstance(batch, (tuple, list)) and isinstance(batch[0], list):
        batch = (tuple(batch[0]), batch[1])  # positional inputs as the tuple they stand for
    elif isinstance(batch, list):
        batch = tuple(batch)
    return model, loss_fn, batch


@contextlib.contextmanager
def _user_code(path: Path, doing: str) -> Iterator[None]:
    """Turn an exception of the user's code into one line: what raised, and where in ``path``."""
    try:
        yield
    except Exception as e:   # the user's code: any exception
        where = ""
        if isinstance(e, SyntaxError) and e.lineno:
            where = f" at line {e.lineno}"
        else:
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if Path(f.filename).resolve() == path.resolve()]
            where = f" at line {frames[-1].lineno}" if frames else ""
        raise ValueError(f"model file {str(path)!r}: {doing} raised {type(e).__name__}: "
                         f"{e}{where}") from e


def load_model_file(text: str, *, device: str, seed: int) -> Parts:
    """Import ``path/to/file.py:fn``, call ``fn()`` and return its checked ``(model, loss_fn, batch)``.

    ``fn`` runs with ``device`` as the default device (so a plain model built on "meta" allocates
    nothing) and with the global RNG seeded by ``seed`` inside ``fork_rng`` (the caller's RNG state
    is untouched). Tensors the function places on an explicit device stay there.
    Raises ValueError if the spec is malformed, the file is missing, it has no callable ``fn``, or
    ``fn()`` returns the wrong structure, and when the file or ``fn()`` raises: one line naming
    the exception and where in the user's file it arose (the original chained as its cause).
    """
    path, fn_name = split_file_spec(text)
    if not path.is_file():
        raise ValueError(f"model file {str(path)!r} (from {text!r}) does not exist or is not a file")
    with _user_code(path, "importing it"):
        module = _import_file(path)
    fn = getattr(module, fn_name, None)
    if fn is None:
        defined = sorted(
            name for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__
        )
        raise ValueError(f"model file {str(path)!r} has no function {fn_name!r}; functions defined there: {defined}")
    if not callable(fn):
        raise ValueError(f"{fn_name!r} in model file {str(path)!r} is a {type(fn).__name__}, not a function")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device), _user_code(path, f"{fn_name}()"):
            result = fn()
    return _check_result(result, f"{str(path)}:{fn_name}()")
