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


# Backward FLOPs (and bytes) per forward's, by op, where not a contraction's 2 or another op's
# 1: meshplan's routed experts (`capture/routed_experts.py`) recompute their two input
# projections in backward besides the six products of a gated MLP's gradients, 8 against the
# forward's 3.
BACKWARD_FACTORS = {"routed_experts": 8.0 / 3.0}


def backward_factor(op: str, kind: str | None) -> float:
    """Backward work per forward work of an op named ``op`` whose signature kind is ``kind``."""
    return BACKWARD_FACTORS.get(op, 2.0 if kind == "contraction" else 1.0)


def forward_backward_times(
    flops: float, nbytes: float, device: DeviceType, dtype: str, backward: float
) -> tuple[float, float]:
    """Forward and backward seconds of one op whose forward does `flops` FLOPs over `nbytes`
    bytes, its backward ``backward`` times that (`backward_factor`). Raises as op_time, and
    TypeError for a bool ``backward`` (this argument was once ``is_contraction``)."""
    if isinstance(backward, bool):
        raise TypeError("forward_backward_times takes the backward's factor (backward_factor"
                        "(op, kind)), not whether the op is a contraction")
    forward = op_time(flops, nbytes, device, dtype)
    return forward, op_time(backward * flops, backward * nbytes, device, dtype)


def train_op_time(
    flops: float, nbytes: float, device: DeviceType, dtype: str, is_contraction: bool
) -> float:
    """Forward plus backward seconds of one op (`forward_backward_times`): backward 2x the
    forward for a contraction, 1x otherwise. Raises as op_time."""
    return sum(forward_backward_times(flops, nbytes, device, dtype,
                                      2.0 if is_contraction else 1.0))
