"""The parts of a step the cost model once left out, each measured on an H200 (docs/gpu.md):
the optimizer's pass over the parameters (25 ms of a bf16 GPT-1.3B step under torch's foreach
AdamW; one pass with the fused kernels the runtime now picks on a GPU) and mixed precision's
casts of fp32 operands to the half type (every weight and fp32 activation a matmul reads, and
their gradients back)."""

from __future__ import annotations

import math

import pytest

import meshplan.api as api
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=256,layers=2,heads=4,seq=64,vocab=512,batch=8"


def _plan(method: str, dtype: str, optimizer: str = "adamw", shape=(1, 4),
          microbatches: int = 1) -> api.Plan:
    w = build_workload(GPT, device="meta")
    return api.plan(w.model, w.loss_fn, optimizer, w.example_batch,
                    f"dgx-a100:1x{math.prod(shape)}", mesh_shape=shape, method=method,
                    dtype=dtype, memory_budget_gb=0, microbatches=microbatches)


def _numel() -> int:
    w = build_workload(GPT, device="meta")
    return sum(p.numel() for p in w.model.parameters())


def test_the_update_is_one_pass_over_each_devices_parameters_and_zero_shares_it() -> None:
    """Adam moves 28 bytes per element it updates (value read and written, gradient read,
    two moments read and written), SGD without momentum 12: data parallelism updates every
    element on every device, ZeRO each device's quarter; the simulated step pays it."""
    bandwidth = parse_cluster_spec("dgx-a100:1").device.effective_mem_bandwidth
    n = _numel()
    data, zero = _plan("data", "fp32"), _plan("zero2", "fp32")
    assert data.predicted["update_s"] == pytest.approx(28 * n / bandwidth)
    assert zero.predicted["update_s"] == pytest.approx(28 * n / 4 / bandwidth, rel=1e-3)
    assert _plan("data", "fp32", "sgd").predicted["update_s"] == pytest.approx(12 * n / bandwidth)
    one = _plan("data", "fp32", shape=(1, 1))   # no communication: compute and the update
    f, b = one.predicted["forward_s"], one.predicted["backward_s"]
    assert simulate(one).step_time_s == pytest.approx(f + b + 28 * n / bandwidth)
    for p in (one, data, zero):
        assert simulate(p).step_time_s == pytest.approx(p.predicted["step_time_s"])


@pytest.mark.parametrize("microbatches", [1, 4])
def test_mixed_precision_pays_its_casts(microbatches: int) -> None:
    """One device, bf16: every fp32 operand of a matmul (the fp32 master weights, the layer
    norms' fp32 outputs) is cast to bf16 in forward, and its gradient back in backward, 6
    bytes per element each way, on top of the matmul's own roofline; a weight's forward cast
    once per step (the runtime keeps it for the later micro-batches), the rest in each."""
    from meshplan.capture.to_ir import capture
    from meshplan.cost.compute import forward_backward_times
    from meshplan.cost.precision import with_compute_dtype
    device = parse_cluster_spec("dgx-a100:1").device
    m = microbatches
    w = build_workload(GPT.replace("batch=8", f"batch={8 // m}"), device="meta")
    graph = with_compute_dtype(capture(w.model, w.loss_fn, w.example_batch)[1], "bf16")
    plan = _plan("data", "bf16", shape=(1, 1), microbatches=m)
    assert plan.microbatches == m
    casts = []
    for o in plan.ops:
        node = graph.by_name[o.node]
        if o.op != "mm":
            continue
        f, b = forward_backward_times(node.flops, node.nbytes, device, "bfloat16", 2.0)
        cast = 0.0
        for u in map(graph.by_name.get, node.inputs):
            if u.out.dtype == "float32":
                weight = u.role == "param" or u.op == "t"
                cast += 6.0 * u.out.numel * ((1 if weight else m) + m * u.requires_grad)
        casts.append(cast)
        assert o.compute == pytest.approx(m * (f + b) + cast / device.effective_mem_bandwidth)
    assert len(casts) >= 8 and all(c > 0 for c in casts)


def test_a_plan_without_room_for_the_half_copies_casts_in_every_micro_batch() -> None:
    """With room, a bf16 step holds its weights' half copies (2 bytes per element, in its
    peak) and casts each weight once per step. Under a budget that fits only without them,
    `api.plan` plans again without (`hold_half_copies`): every micro-batch casts its weights
    again, the step is slower and smaller, and the runtime keeps no copies for it."""
    w = build_workload(GPT, device="meta")
    copies = 2 * sum(p.numel() for p in w.model.parameters() if p.dim() == 2)

    def plan(budget_gb: float) -> api.Plan:
        return api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "dgx-a100:1x1",
                        mesh_shape=(1, 1), method="data", dtype="bf16", microbatches=4,
                        memory_budget_gb=budget_gb)

    held = plan(0)
    need = held.predicted["peak_memory_bytes"]
    budget = need - copies / 2
    tight = plan(budget / 2**30)
    assert held.options["hold_half_copies"] and not tight.options["hold_half_copies"]
    assert tight.predicted["peak_memory_bytes"] <= budget < need
    assert tight.predicted["step_time_s"] > held.predicted["step_time_s"]
    with pytest.raises(api.InfeasiblePlanError):   # the fallback too has its floor
        plan(tight.predicted["peak_memory_bytes"] / 2 / 2**30)
