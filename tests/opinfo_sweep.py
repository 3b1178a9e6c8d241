"""PyTorch's own operator database (OpInfo) as a breadth check of capture, planning and lowering.

For an op, its first float32 CPU sample input becomes a tiny training problem: the sample's first
float tensor is a parameter plus a batch input of the same shape (so both a parameter and a batch
flow into the op), every other tensor of the sample is a buffer, and the loss is the sum of the
op's float outputs. meshplan captures it, plans it on (1, 2) and (2, 2) meshes and trains two SGD
steps on emulated ranks against the single device. Each op ends in one outcome:

- ``equal``: every plan trained like one device (losses, parameters, recorded == planned);
- ``differs``: a plan trained differently (a wrong result: the worst outcome);
- ``refused``: meshplan declined with its own clear error (a ValueError/TypeError/
  NotImplementedError raised by meshplan's own code, naming the problem: random ops,
  data-dependent shapes, ...);
- ``crash``: any other exception, including those types raised inside torch (a bug to fix);
- ``timeout``: the op took longer than its time limit (see `run_op_limited`);
- ``skipped``: the sample itself has no float tensor to train or fails on one device.

``signed`` tells whether every op of the captured program had a dimension signature.
"""

from __future__ import annotations

import functools
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import meshplan
import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import Workload

_PACKAGE = Path(meshplan.__file__).resolve().parent
SGD = OptimizerSpec("sgd", lr=0.01)
SHAPES = ((1, 2), (2, 2))
# Ops whose outputs are uninitialized memory: one device sums garbage, so no plan can "equal" it.
UNSPECIFIED_VALUES = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided",
                                "empty_strided", "empty_permuted"})
REFUSALS = (ValueError, TypeError, NotImplementedError)


@dataclass(frozen=True)
class Outcome:
    op: str
    variant: str
    outcome: str
    signed: bool | None
    reason: str = ""


@functools.cache
def float32_ops() -> list[Any]:
    """Every OpInfo with float32 CPU support, in the database's order (computed once)."""
    from torch.testing._internal.common_methods_invocations import op_db
    _draw_from_the_callers_generator()
    return [op for op in op_db if op.supports_dtype(torch.float32, "cpu")]


def _draw_from_the_callers_generator() -> None:
    """OpInfo wraps random ops in ``wrapper_set_seed``, which reseeds the global generator (42)
    inside the call: a reseed a traced program cannot see. Unwrapped, a random op draws from
    the generator each training step seeds, as a user's model does (see tests/oracle.py)."""
    import sys

    from torch.testing import _utils
    seeded = _utils.wrapper_set_seed

    def unseeded(op: Any, *args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "wrapper_set_seed", None) is seeded:
            module.wrapper_set_seed = unseeded


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _leaves(item)]
    return [x]


@dataclass(frozen=True)
class _Slot:
    """Where the k-th tensor of a sample goes when the module calls the op."""

    k: int


def _slots(x: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _Slot(len(tensors) - 1)
    if isinstance(x, (list, tuple)):
        return type(x)(_slots(y, tensors) for y in x)
    if isinstance(x, dict):
        return {k: _slots(v, tensors) for k, v in x.items()}
    return x


class OpModule(nn.Module):
    """``op(param + x, *others)`` summed into a scalar (see the module docstring)."""

    def __init__(self, op: Any, sample: Any) -> None:
        super().__init__()
        self.op = op
        tensors: list[torch.Tensor] = []
        self.template = _slots((sample.input, tuple(sample.args), dict(sample.kwargs)), tensors)
        floats = [k for k, t in enumerate(tensors) if t.is_floating_point()]
        if not floats:
            raise LookupError("no float tensor in the sample")
        self.first = floats[0]
        self.param = nn.Parameter(tensors[self.first].detach().clone())
        for k, t in enumerate(tensors):
            if k != self.first:
                self.register_buffer(f"t{k}", t.detach().clone())

    @property
    def first_shape(self) -> torch.Size:
        return self.param.shape

    def _fill(self, x: Any, first: torch.Tensor) -> Any:
        if isinstance(x, _Slot):
            return first if x.k == self.first else getattr(self, f"t{x.k}")
        if isinstance(x, (list, tuple)):
            return type(x)(self._fill(y, first) for y in x)
        if isinstance(x, dict):
            return {k: self._fill(v, first) for k, v in x.items()}
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, args, kwargs = self._fill(self.template, self.param + x)
        out = self.op.op(inp, *args, **kwargs)
        total = self.param.sum() * 0.0
        for y in _leaves(out):
            if isinstance(y, torch.Tensor) and y.is_floating_point():
                total = total + y.sum()
        return total


def _loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out


def build_case(op: Any) -> tuple[Workload, list] | None:
    """The op's training problem, or None when its first sample gives none."""
    try:
        sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)))
        torch.manual_seed(0)
        model = OpModule(op, sample)
    except (StopIteration, LookupError, RuntimeError, KeyError):
        return None
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(model.first_shape, generator=g) * 0.01,), torch.zeros(()))
            for _ in range(2)]
    return Workload(model, _loss, data[0], op.name), data


def _reference(w: Workload, data: list) -> tuple[list[float], dict]:
    from oracle import reference
    return reference(w, SGD, data)


def run_op(op: Any) -> Outcome:
    """Capture, plan and train one op (see the module docstring)."""
    from oracle import assert_matches, train_rank
    name, variant = op.name, op.variant_test_name
    if name in UNSPECIFIED_VALUES:
        return Outcome(name, variant, "skipped", None,
                       "values unspecified (uninitialized memory): nothing to compare")
    case = build_case(op)
    if case is None:
        return Outcome(name, variant, "skipped", None, "no float sample")
    w, data = case
    try:
        ref = _reference(w, data)
        if not all(torch.isfinite(torch.tensor(ref[0]))):
            return Outcome(name, variant, "skipped", None, "non-finite loss on one device")
    except Exception as e:  # the sample itself does not train on one device
        return Outcome(name, variant, "skipped", None, _first_line(e))
    signed = None
    try:
        captured = capture(w.model, w.loss_fn, w.example_batch)
        signed = not captured[1].unsupported_ops
        for shape in SHAPES:
            for method, units in (("auto", {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)}),
                                  ("data", {})):
                plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch,
                                f"local:{shape[0] * shape[1]}", mesh_shape=shape,
                                method=method, memory_budget_gb=0, **units)
                for r in run_emulated(train_rank, shape, plan, w, data, captured):
                    try:
                        assert_matches(r, ref, plan, SGD, tol=1e-4)
                    except AssertionError as e:
                        return Outcome(name, variant, "differs", signed,
                                       f"{method} {shape}: {_first_line(e)}")
    except REFUSALS as e:
        if _raised_by_meshplan(e):
            return Outcome(name, variant, "refused", signed, _first_line(e))
        return Outcome(name, variant, "crash", signed,
                       f"{type(e).__name__}: {_first_line(e)} @ {_origin(e)}")
    except OpTimeout:
        raise
    except Exception as e:  # noqa: BLE001 -- classifying every failure is the point
        return Outcome(name, variant, "crash", signed,
                       f"{type(e).__name__}: {_first_line(e)} @ {_origin(e)}")
    return Outcome(name, variant, "equal", signed)


class OpTimeout(Exception):
    """An op ran past its time limit (raised from SIGALRM in `run_op_limited`)."""


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise OpTimeout()


def run_op_limited(op: Any, limit_s: int) -> Outcome:
    """`run_op` with a wall-clock limit (main thread of a process only: SIGALRM)."""
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(limit_s)
    try:
        return run_op(op)
    except OpTimeout:
        return Outcome(op.name, op.variant_test_name, "timeout", None, f"over {limit_s} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def label(o: Outcome) -> str:
    return f"{o.op}.{o.variant}" if o.variant else o.op


def sample_ops(ops: list[Any], n: int, seed: int) -> list[Any]:
    """``n`` ops drawn without replacement by a seeded generator, in database order."""
    g = torch.Generator().manual_seed(seed)
    picked = sorted(torch.randperm(len(ops), generator=g)[:n].tolist())
    return [ops[i] for i in picked]


def _raised_by_meshplan(e: BaseException) -> bool:
    """The innermost frame that raised ``e`` is meshplan's own code (not torch's, nor this
    harness's): a deliberate refusal, not a library error passing through."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def _origin(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "meshplan" in f.filename]
    return f"{frames[-1].filename.split('meshplan/')[-1]}:{frames[-1].lineno}" if frames else "?"
