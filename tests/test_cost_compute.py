"""Roofline op time and its training (forward + backward) variant."""

from __future__ import annotations

import pytest

from meshplan.cost.compute import op_time, train_op_time
from meshplan.cost.devices import DeviceType, device_type

TOY = DeviceType("toy", {"float32": 100.0, "bfloat16": 400.0}, 1e9, 10.0, 0.5)


def test_compute_bound_and_memory_bound() -> None:
    # 100 FLOP/s peak at 50 % efficiency: 1000 FLOPs take 20 s; 50 bytes at 10 B/s take 5 s.
    assert op_time(1000, 50, TOY) == 20.0
    assert op_time(10, 500, TOY) == 50.0
    assert op_time(1000, 50, TOY, "bfloat16") == 5.0


def test_a100_big_matmul_time() -> None:
    a100 = device_type("A100-SXM4-80GB")
    n = 8192
    flops, nbytes = 2 * n**3, 3 * n * n * 2
    half, full = a100.matmul_efficiency("bfloat16"), a100.matmul_efficiency("float32")
    expected = flops / (312e12 * half)
    assert op_time(flops, nbytes, a100, "bfloat16") == pytest.approx(expected)
    # the same matmul in strict fp32: 16x the peak's gap (19.5 vs 312 TFLOP/s), at fp32's
    # own (uncalibrated, lower) efficiency
    assert op_time(flops, 2 * nbytes, a100, "float32") == pytest.approx(
        16 * expected * half / full)


def test_efficiency_per_dtype_and_memory_efficiency() -> None:
    dev = DeviceType("x", {"float32": 100.0, "float16": 400.0}, 1e9, 10.0,
                     {"float16": 0.5}, memory_efficiency=0.5)
    assert dev.matmul_efficiency("float16") == 0.5
    assert dev.matmul_efficiency("float32") == 0.5   # a dtype left out: the smallest given
    assert op_time(1000, 0, dev, "float16") == pytest.approx(1000 / 200)
    assert op_time(0, 50, dev) == pytest.approx(50 / 5)   # 10 B/s at half efficiency
    with pytest.raises(ValueError, match="memory_efficiency"):
        DeviceType("x", {"float32": 1.0}, 1e9, 1.0, 0.5, memory_efficiency=1.5)
    with pytest.raises(ValueError, match="efficiency"):
        DeviceType("x", {"float32": 1.0}, 1e9, 1.0, {"float32": 0.0})


def test_train_op_time_backward_factor() -> None:
    forward = op_time(1000, 50, TOY)
    assert train_op_time(1000, 50, TOY, "float32", is_contraction=True) == pytest.approx(3 * forward)
    assert train_op_time(1000, 50, TOY, "float32", is_contraction=False) == pytest.approx(2 * forward)
    # memory-bound elementwise op: backward reads/writes about as much as forward
    assert train_op_time(0, 500, TOY, "float32", is_contraction=False) == 100.0


def test_zero_work_is_free() -> None:
    assert op_time(0, 0, TOY) == 0.0


@pytest.mark.parametrize(
    ("flops", "nbytes", "dtype", "error", "match"),
    [
        (-1, 0, "float32", ValueError, "flops"),
        (1, float("nan"), "float32", ValueError, "nbytes"),
        ("1", 0, "float32", TypeError, "flops"),
        (1, 0, "float16", ValueError, r"no peak for dtype 'float16'; known: \['bfloat16', 'float32'\]"),
    ],
)
def test_op_time_errors(flops: object, nbytes: object, dtype: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        op_time(flops, nbytes, TOY, dtype)  # type: ignore[arg-type]
