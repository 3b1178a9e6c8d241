"""Optimizer-state sizes and per-device parameter memory under replicated / ZeRO-2 / ZeRO-3."""

from __future__ import annotations

import pytest

from meshplan.cost.memory import ParamMemory, optimizer_state_bytes_per_param, param_memory_per_device


@pytest.mark.parametrize(
    ("optimizer", "param_bytes", "momentum", "expected"),
    [
        ("sgd", 4, False, 0.0),
        ("sgd", 4, True, 4.0),
        ("SGD", 2, True, 2.0),
        ("adam", 4, False, 8.0),
        ("adamw", 4, False, 8.0),
        ("adam", 2, True, 4.0),
    ],
)
def test_optimizer_state_bytes(optimizer: str, param_bytes: int, momentum: bool, expected: float) -> None:
    assert optimizer_state_bytes_per_param(optimizer, param_bytes, momentum=momentum) == expected


def test_unknown_optimizer_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'lamb'; valid optimizers: \['sgd', 'adam', 'adamw', 'adafactor'\]"):
        optimizer_state_bytes_per_param("lamb")


def test_fp32_adam_is_16_bytes_per_param() -> None:
    memory = param_memory_per_device(1000, "replicated")
    assert memory == ParamMemory(4000.0, 4000.0, 8000.0)
    assert memory.total == 16 * 1000


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # numel 4800, tp 2, dp 4, fp32 Adam
        ("replicated", (4800 * 4 / 2, 4800 * 4 / 2, 4800 * 8 / 2)),
        ("zero2", (4800 * 4 / 2, 4800 * 4 / 8, 4800 * 8 / 8)),
        ("zero3", (4800 * 4 / 8, 4800 * 4 / 8, 4800 * 8 / 8)),
    ],
)
def test_update_modes(mode: str, expected: tuple[float, float, float]) -> None:
    memory = param_memory_per_device(4800, mode, tp_size=2, dp_size=4)
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == expected


def test_zero_paper_stage_formulas() -> None:
    # ZeRO (arXiv 1910.02054) with K = 12: stage 2 holds 2Ψ + (2+K)Ψ/Nd, stage 3 (4+K)Ψ/Nd.
    psi, nd = 7_500_000_000 // 64 * 64, 64
    mixed = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes_per_param": 12.0, "dp_size": nd}
    assert param_memory_per_device(psi, "replicated", **mixed).total == 16 * psi
    assert param_memory_per_device(psi, "zero2", **mixed).total == 2 * psi + 14 * psi / nd
    assert param_memory_per_device(psi, "zero3", **mixed).total == 16 * psi / nd


def test_uneven_shards_are_padded() -> None:
    memory = param_memory_per_device(10, "zero3", dp_size=4)
    assert memory.param_bytes == 3 * 4  # ceil(10 / 4) = 3 elements


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "zero1"}, ValueError, r"unknown update mode 'zero1'; valid modes: \['replicated', 'zero2', 'zero3', 'sfb'\]"),
        ({"tp_size": 0}, ValueError, "tp_size"),
        ({"dp_size": 1.5}, TypeError, "dp_size"),
        ({"numel": -3}, ValueError, "numel"),
        ({"param_bytes": 0}, ValueError, "param_bytes"),
        ({"optimizer_bytes_per_param": -1.0}, ValueError, "optimizer_bytes_per_param"),
    ],
)
def test_param_memory_errors(kwargs: dict, error: type[Exception], match: str) -> None:
    args = {"numel": 16, "mode": "zero2"} | kwargs
    with pytest.raises(error, match=match):
        param_memory_per_device(**args)
