"""Per-device memory of a parameter: its values, its gradient and its optimizer state.

Convention: fp32 training keeps a 4-byte parameter, a 4-byte gradient and, for Adam, two 4-byte
states (first and second moments), i.e. 16 B per parameter. That equals ZeRO's 16Ψ figure for mixed
precision (2 fp16 param + 2 fp16 grad + 12 fp32 master/momentum/variance) by coincidence; the
mixed-precision split is expressed here with param_bytes=2, grad_bytes=2,
optimizer_bytes_per_param=12.

Update modes (DESIGN.md §3.5), for a parameter sharded tp-way by its compute strategy and a
data-parallel group of dp devices:

    replicated   params, grads, optimizer state all / tp
    zero2        params / tp; grads and optimizer state / (tp · dp)
    zero3        params, grads, optimizer state all / (tp · dp)
    sfb          as replicated (sufficient-factor broadcasting computes the gradient whole)

Shards are padded to whole elements (ceil(numel / ways)), as sharded storage does in practice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from meshplan.cost.checks import check_count, check_nonnegative

UPDATE_MODES: tuple[str, ...] = ("replicated", "zero2", "zero3", "sfb")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw", "adafactor")

# ZeRO's reduce-scatters a backward keeps in flight at once beside the one it issues last
# (`runtime/trainer.py`, `runtime/zero3.py`): each holds a whole gradient until it is waited for,
# so a backward holds the ones in flight and the newest gradient; waited for only at the end
# of the backward, a stage held every ZeRO gradient of a micro-batch at once.
ZERO_SCATTERS_IN_FLIGHT = 1


def optimizer_state_bytes_per_param(optimizer: str, param_bytes: int = 4, momentum: bool = False) -> float:
    """Optimizer-state bytes per parameter element: "sgd" 0 (or one `param_bytes` buffer with
    `momentum`), "adam"/"adamw" 2 × `param_bytes` (first and second moments; `momentum` is ignored),
    "adafactor" 0 per element (its state is per row and column: `OptimizerState`).

    Raises ValueError naming the optimizer and the valid ones."""
    check_count(param_bytes, "param_bytes")
    name = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if name == "sgd":
        return float(param_bytes) if momentum else 0.0
    if name in ("adam", "adamw"):
        return 2.0 * param_bytes
    if name == "adafactor":
        return 0.0
    raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {list(OPTIMIZERS)}")


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps for a parameter, in bytes per element of the parameter.

    ``per_element`` bytes for every element (Adam's two fp32 moments: 8; SGD's momentum: 4).
    ``factored`` (Adafactor, as torch.optim.Adafactor keeps it): a parameter of two or more
    dimensions keeps one fp32 second-moment statistic per row and one per column of its last two
    dimensions, (R + C) per R × C matrix instead of R·C; a vector keeps one per element. Per
    device the statistics shrink with the parameter's shard (a column statistic is in fact
    replicated over the devices splitting rows; at (R + C)/(R·C) of the parameter the difference
    is noise)."""

    per_element: float = 8.0
    factored: bool = False

    def update_bytes_per_element(self, shape: tuple[int, ...]) -> float:
        """Bytes the update moves through device memory per element it updates: the fp32
        master value read and written, its gradient read, the state read and written, once
        each, as torch's fused Adam, AdamW and SGD kernels do in one pass (the runtime's
        choice on a GPU: `runtime/optim.make_optimizer`)."""
        return 12.0 + 2.0 * self.bytes_per_element(shape)

    def bytes_per_element(self, shape: tuple[int, ...]) -> float:
        """Optimizer-state bytes per element of a parameter of ``shape``."""
        if not self.factored:
            return self.per_element
        if len(shape) < 2 or not shape[-1] or not shape[-2]:
            return self.per_element + 4.0
        rows, cols = shape[-2], shape[-1]
        return self.per_element + 4.0 * (rows + cols) / (rows * cols)


def _shard_numel(numel: int, ways: int) -> int:
    return -(-numel // ways)  # ceil without float rounding for very large tensors


@dataclass(frozen=True)
class ParamMemory:
    """Bytes one device holds for one parameter: values, gradient and optimizer state."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float

    @property
    def total(self) -> float:
        """param_bytes + grad_bytes + optimizer_bytes."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def param_memory_per_device(
    numel: int,
    mode: str,
    tp_size: int = 1,
    dp_size: int = 1,
    param_bytes: int = 4,
    grad_bytes: int | None = None,
    optimizer_bytes_per_param: float = 8.0,
) -> ParamMemory:
    """Per-device memory of a parameter of `numel` elements under update `mode` (module docstring).

    `tp_size`: devices the parameter is split over by its compute strategy; `dp_size`: the
    data-parallel group ZeRO shards over. `param_bytes` / `grad_bytes` (default = param_bytes) are
    bytes per element; `optimizer_bytes_per_param` defaults to Adam in fp32 (8). Raises ValueError
    for an unknown mode (listing the valid ones) or non-positive sizes."""
    if mode not in UPDATE_MODES:
        raise ValueError(f"unknown update mode {mode!r}; valid modes: {list(UPDATE_MODES)}")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    tp, dp = check_count(tp_size, "tp_size"), check_count(dp_size, "dp_size")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    check_count(param_bytes, "param_bytes")
    check_count(grad_bytes, "grad_bytes")
    opt = check_nonnegative(optimizer_bytes_per_param, "optimizer_bytes_per_param")
    param_elems = _shard_numel(numel, tp * dp if mode == "zero3" else tp)
    state_elems = updated_elements(numel, mode, tp, dp)
    return ParamMemory(
        float(param_elems * param_bytes), float(state_elems * grad_bytes), float(state_elems * opt)
    )


def updated_elements(numel: int, mode: str, tp_size: int = 1, dp_size: int = 1) -> int:
    """The elements of a parameter of ``numel`` one device updates (and keeps the gradient and
    optimizer state of) under update ``mode``: its shard of ``tp_size``, under ZeRO also split
    over the ``dp_size`` data-parallel devices."""
    return _shard_numel(numel, tp_size if mode in ("replicated", "sfb") else tp_size * dp_size)


def unsharded_state_bytes(shapes: Iterable[tuple[int, ...]], state: OptimizerState) -> float:
    """Values, gradients and optimizer state of parameters of ``shapes`` kept whole on one
    device (fp32 masters): over N devices, /N is a lower bound of any plan's share."""
    return sum(param_memory_per_device(math.prod(s), "replicated",
                                       optimizer_bytes_per_param=state.bytes_per_element(s)).total
               for s in shapes)
