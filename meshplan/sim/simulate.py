"""A plan's training step on a virtual clock: the figures users judge a plan by.

The per-mesh instruction lists are the ones the runtime executes (`lower/pipeline_program.py`;
a single-stage plan runs its micro-batches one after another, forward then backward, as
`runtime/trainer.py` does), executed by `engine.simulate_programs` with the durations of
`task_costs.py`. FLOPs are counted as Megatron-LM counts them: a training step does three
forward passes' worth of model FLOPs (forward, and twice that in backward), four for a stage
that recomputes its whole forward, three plus what it replays for one that recomputes part of
it (stage by stage: in a pipeline only some may); MFU counts three whatever the plan
recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshplan.collector import cycle_collector_paused
from meshplan.cost.cluster import cluster_from_dict
from meshplan.cost.precision import DTYPES
from meshplan.lower.instructions import mesh_programs
from meshplan.lower.pipeline_program import pipeline_program
from meshplan.lower.schedules import make_schedule
from meshplan.plan.explain import format_bytes
from meshplan.plan.plan import Plan
from meshplan.sim.engine import Timeline, simulate_programs
from meshplan.sim.task_costs import TransferCosts, stage_plans, task_cost


@dataclass(frozen=True)
class Simulation:
    """One simulated step of a plan. ``peak_memory_bytes[d]``: device d's peak (global ranks);
    ``tflops_per_device`` counts recomputation as Megatron-LM does, ``mfu`` does not."""

    timeline: Timeline
    step_time_s: float
    samples_per_s: float
    tflops_per_device: float
    mfu: float
    bubble_fraction: float
    peak_memory_bytes: tuple[float, ...]

    def summary(self) -> dict[str, Any]:
        """The JSON object of the CLI's ``simulated``."""
        return {"step_time_s": self.step_time_s, "samples_per_s": self.samples_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "peak_memory_bytes": list(self.peak_memory_bytes)}


def simulate(plan: Plan) -> Simulation:
    """Simulate one training step of ``plan`` (module docstring) on its cluster (also when it
    was chosen in abstract α-β units). Raises ValueError for a plan made before the
    simulator (no figures to run on)."""
    with cycle_collector_paused():   # a long pipeline's timeline is 100,000s of spans
        return _simulate(plan)


def _simulate(plan: Plan) -> Simulation:
    cluster = cluster_from_dict(plan.cluster)
    plans = stage_plans(plan)
    costs = {s: task_cost(p, plan.stages[s] if len(plans) > 1 else None)
             for s, p in enumerate(plans)}
    if len(plan.stages) <= 1:
        schedule = make_schedule("1f1b", 1, plan.microbatches, 1)
        programs = mesh_programs(schedule, {})
        meshes = [tuple(range(plan.num_devices))]
        timeline = simulate_programs(programs, costs, lambda s: 0, lambda *_: 0.0)
    else:
        program = pipeline_program(plan)
        transfers = TransferCosts(cluster, plan.microbatches, plan.transfers)
        tied = transfers.tied_s()
        if tied:   # the tied gradients cross before the update of each holder
            holders = _holders(plans)
            costs = {s: replace(c, update_s=c.update_s + tied) if s in holders else c
                     for s, c in costs.items()}
        n = program.schedule.num_meshes
        timeline = simulate_programs(program.programs, costs, lambda s: s % n,
                                     lambda ins, *_: transfers.send_s(ins))
        meshes = list(program.meshes)
    step = timeline.step_time_s
    peaks = timeline.peak_memory()
    per_device = [0.0] * cluster.num_devices
    for m, ranks in enumerate(meshes):
        for r in ranks:
            per_device[r] = peaks[m]
    flops = [p.predicted.get("forward_flops", 0.0) * plan.microbatches for p in plans]
    forward_flops = sum(flops)
    # The FLOPs run: three forwards' worth, plus what a recomputed stage replays (a plan of
    # an older meshplan: its whole forward, as Megatron-LM counts full recomputation).
    counted = sum(3 * f + (p.predicted.get("replay_flops", p.predicted.get("forward_flops", 0.0))
                           * plan.microbatches if rc else 0.0)
                  for f, p, rc in zip(flops, plans, recomputed_stages(plan)))
    devices = cluster.num_devices
    peak = cluster.device.peak(DTYPES[plan.dtype])
    batch = plans[0].predicted.get("batch_size", 0)
    return Simulation(
        timeline=timeline, step_time_s=step,
        samples_per_s=batch / step if step else 0.0,
        tflops_per_device=counted / (step * devices) / 1e12 if step else 0.0,
        mfu=3 * forward_flops / (step * devices * peak) if step else 0.0,
        bubble_fraction=timeline.bubble_fraction(),
        peak_memory_bytes=tuple(per_device))


def recomputed_stages(plan: Plan) -> list[bool]:
    """Whether each (virtual) stage of ``plan`` recomputes its forward, in `stage_plans`
    order."""
    if len(plan.stages) <= 1:
        return [plan.recompute]
    return [s.recompute for s in plan.stages]


def _holders(plans: list[Plan]) -> set[int]:
    """The stages holding a parameter another stage holds too."""
    seen: dict[str, set[int]] = {}
    for s, p in enumerate(plans):
        for d in p.params:
            seen.setdefault(d.name, set()).add(s)
    return {s for stages in seen.values() if len(stages) > 1 for s in stages}


def format_simulation(plan: Plan, sim: Simulation, files: tuple[str, ...] = ()) -> str:
    """The simulated figures as text, next to the planner's estimate."""
    estimate = plan.predicted.get("step_time_s", 0.0)
    peaks = sim.peak_memory_bytes
    lines = [
        f"simulated step of {plan.model} on {plan.cluster.get('name', '?')} "
        f"({len(peaks)} devices, {plan.num_stages} stage{'s' * (plan.num_stages > 1)}, "
        f"{plan.microbatches} micro-batches, {plan.dtype})",
        f"  step time        {sim.step_time_s * 1e3:,.3f} ms (planner's estimate "
        f"{estimate * 1e3:,.3f} ms)",
        f"  throughput       {sim.samples_per_s:,.2f} samples/s",
        f"  TFLOP/s/device   {sim.tflops_per_device:,.2f}"
        + (" (recomputation counted, as Megatron-LM counts it)" if plan.recompute else ""),
        f"  MFU              {sim.mfu:.1%}",
        f"  pipeline bubble  {sim.bubble_fraction:.1%}",
        f"  peak memory      {format_bytes(max(peaks))} per device at most, "
        f"{format_bytes(min(peaks))} at least",
    ]
    if files:
        lines.append(f"  timeline         {', '.join(files)}")
    return "\n".join(lines)
