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

Shards are padded to whole elements (ceil(numel / ways)), as sharded storage does in practice.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost.checks import check_count, check_nonnegative

UPDATE_MODES: tuple[str, ...] = ("replicated", "zero2", "zero3")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")


def optimizer_state_bytes_per_param(optimizer: str, param_bytes: int = 4, momentum: bool = False) -> float:
    """Optimizer-state bytes per parameter element: "sgd" 0 (or one `param_bytes` buffer with
    `momentum`), "adam"/"adamw" 2 × `param_bytes` (first and second moments; `momentum` is ignored).

    Raises ValueError naming the optimizer and the valid ones."""
    check_count(param_bytes, "param_bytes")
    name = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if name == "sgd":
        return float(param_bytes) if momentum else 0.0
    if name in ("adam", "adamw"):
        return 2.0 * param_bytes
    raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {list(OPTIMIZERS)}")


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
    state_elems = _shard_numel(numel, tp if mode == "replicated" else tp * dp)
    return ParamMemory(
        float(param_elems * param_bytes), float(state_elems * grad_bytes), float(state_elems * opt)
    )
