"""Roofline compute time of one op on one device (DESIGN.md §4).

An op takes max(FLOPs / (peak · efficiency), bytes / effective memory bandwidth) seconds: it is bound either by
arithmetic or by moving its operands through device memory. For training, the backward of a
contraction (matmul, conv, einsum) does twice the forward work — one product for the input
gradient and one for the weight gradient — while the backward of any other op is taken as one
more pass of the same size (elementwise and reduction gradients read and write about as much as
the forward did).
"""

from __future__ import annotations

from meshplan.cost.checks import check_nonnegative
from meshplan.cost.devices import DeviceType


def op_time(flops: float, nbytes: float, device: DeviceType, dtype: str = "float32") -> float:
    """Seconds for one op doing `flops` FLOPs and moving `nbytes` bytes of device memory:
    max(flops / (peak(dtype) · efficiency(dtype)), nbytes / (mem_bandwidth · memory_efficiency)).

    Raises TypeError/ValueError for negative or non-numeric amounts, ValueError for a dtype the
    device has no peak for."""
    compute = check_nonnegative(flops, "flops") / device.matmul_flops(dtype)
    memory = check_nonnegative(nbytes, "nbytes") / device.effective_mem_bandwidth
    return max(compute, memory)


def forward_backward_times(
    flops: float, nbytes: float, device: DeviceType, dtype: str, is_contraction: bool
) -> tuple[float, float]:
    """Forward and backward seconds of one op whose forward does `flops` FLOPs over `nbytes`
    bytes. Backward is 2× the forward (FLOPs and bytes) for a contraction, 1× otherwise. Raises
    as op_time."""
    backward_factor = 2.0 if is_contraction else 1.0
    forward = op_time(flops, nbytes, device, dtype)
    return forward, op_time(backward_factor * flops, backward_factor * nbytes, device, dtype)


def train_op_time(
    flops: float, nbytes: float, device: DeviceType, dtype: str, is_contraction: bool
) -> float:
    """Forward plus backward seconds of one op (`forward_backward_times`). Raises as op_time."""
    return sum(forward_backward_times(flops, nbytes, device, dtype, is_contraction))
