"""Issue 27.3: ``auto`` is never slower than a baseline, as simulated: on reduced-depth
versions of the weak-scaling suite's rows (`benchmarks/weak_scaling.py --reduced`: each row's
widths, cluster and dtype, two layers and a small batch), auto's plan fits the device as the
simulator runs it, and its simulated step is within 0.5 % of the fastest baseline that fits
(megatron-grid, expert, inter-only, intra-only), or ahead. The full rows are the benchmark's.

One row of each suite, at a CI's cost (all 21 in docs/benchmarks.md): GPT-2.6B's on 8 V100
(megatron-grid, the issue's yardstick; auto's plan beats intra-only's and the grid's, 0.0596 s
against 0.0626 and 0.0605 at session 55), MoE-690M's on 2 (expert parallelism, inter-only's
two-stage pipeline) and Wide-ResNet-500M's on 2 (data parallelism against a two-stage
pipeline). Wide-ResNet-2B's row was here for the data-parallel all-reduce the runtime overlaps,
which eq. 1 once priced 13 % dear; with the ILP's overlap term removed, auto now beats every
baseline on that row anyway (`tests/test_overlap.py` holds the term), and it cost 55 s."""

from __future__ import annotations

import pytest

import meshplan.api as api
from meshplan.errors import InfeasiblePlanError, NoPipelineError
from meshplan.runtime.optim import OptimizerSpec
from meshplan.sim.simulate import simulate
from meshplan.zoo.spec import build_workload

from bench_modules import load

ws = load("weak_scaling")
ROWS = ("gpt-2.6b", "moe-690m", "wresnet-500m")


def simulated(row, method: str, w) -> tuple[float, bool] | None:
    """(simulated step seconds, fits the device as simulated) of ``method``'s plan of
    ``row`` (its workload ``w``); None when the method has no plan within the device's
    memory."""
    try:
        plan = api.plan(w.model, w.loss_fn, OptimizerSpec.from_dict(row.optimizer),
                        w.example_batch, row.cluster, method=method, dtype=row.dtype)
    except (InfeasiblePlanError, NoPipelineError):
        return None
    sim = simulate(plan)
    device = api._cluster(row.cluster).device.memory_bytes
    return sim.step_time_s, max(sim.peak_memory_bytes) <= device


@pytest.mark.parametrize("name", ROWS)
def test_auto_is_no_slower_than_any_baseline_that_fits(name: str) -> None:
    row = ws.REDUCED_ROWS[f"{name}-reduced"]
    w = build_workload(row.spec, device="meta")   # one model: its captures are shared
    runs = {m: simulated(row, m, w) for m in ws.METHODS[row.suite]}
    auto = runs.pop("auto")
    assert auto is not None and auto[1], (name, auto)
    fitting = {m: r[0] for m, r in runs.items() if r is not None and r[1]}
    assert fitting, runs   # something to compare with
    best = min(fitting, key=fitting.get)
    assert auto[0] <= fitting[best] * 1.005, (name, auto[0], best, fitting)
