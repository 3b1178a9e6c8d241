"""What each instruction of a plan costs: the durations the simulator's clock advances by.

A stage's RUN of one micro-batch is its program's compute on one device plus the collectives
the program issues in line in that pass (forward-phase ones in the forward, backward- and
recompute-phase ones in the backward), with the ones the runtime overlaps (`Plan.overlap`: a
ZeRO-3 unit's prefetched gathers, ZeRO reduce-scatters) on a stream beside the compute, as
`lower/overlap.step_passes` times them. APPLY_GRAD is what the step's last backward leaves of
its gradient buckets, overlapped with that backward, and the update's own collectives. A SEND moves one micro-batch's share of the plan's listed
point-to-point messages between the two stages (`Plan.transfers`): every rank sends its own
at once, so a SEND lasts as long as its busiest link — a host's network for messages between
hosts (the inter-host bandwidth is per host), a device's link inside a host.

Compute and memory come from the stage plan's own figures (`Plan.predicted`, written by
the planner's `extract`), collectives from the cost model on the stage's mesh: the same
numbers the planner priced, which is why single-stage plans agree with its estimate.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from meshplan.cost.cluster import Cluster, cluster_from_dict
from meshplan.cost.mesh import logical_mesh, with_shares
from meshplan.lower.instructions import Instruction
from meshplan.lower.overlap import step_passes
from meshplan.plan.plan import Plan, StagePlan, TransferEntry
from meshplan.sim.engine import TaskCost

# The plan figures a stage's tasks are built from (`planner/intra/extract.py`).
NEEDED = ("forward_s", "backward_s", "state_bytes", "activation_bytes")


def stage_plans(plan: Plan) -> list[Plan]:
    """The intra-operator plan of every (virtual) stage, in order: the plan itself when it
    has one stage."""
    if len(plan.stages) <= 1:
        return [plan]
    return [s.plan for s in plan.stages]


def task_cost(p: Plan, stage: StagePlan | None = None) -> TaskCost:
    """The tasks of the stage whose intra-operator plan is ``p`` (module docstring); a
    pipeline ``stage`` keeps per micro-batch in flight what its planned peak says (with
    recomputation: each layer's inputs). Raises ValueError for a plan without the figures
    the simulator reads (made by an older meshplan: plan it again)."""
    missing = [k for k in NEEDED if k not in p.predicted]
    if missing:
        raise ValueError(f"plan {p.model!r} lacks {missing} in its predictions: it was made by "
                         "an older meshplan; make the plan again to simulate it")
    flat = logical_mesh(cluster_from_dict(p.cluster), tuple(p.mesh_shape))
    # Each collective on its model segment's shares (one segment: the plan's axis weights).
    meshes = [with_shares(flat, w, p.options.get("gather_impl", "auto"))
              for w in p.segment_weights or (p.axis_weights,)]
    forward, backward, update = step_passes(
        p.predicted["forward_s"], p.predicted["backward_s"], p.collectives, p.overlap, meshes,
        p.microbatches, replay_s(p), p.predicted.get("update_s", 0.0))
    state = p.predicted["state_bytes"]
    working = p.predicted.get("working_bytes", 0.0)
    kept = full = p.predicted["activation_bytes"]
    if "layered_kept_bytes" in p.predicted:   # recomputed layer by layer: the layers' inputs
        kept = full = p.predicted["layered_kept_bytes"]
    elif stage is not None:
        # The stage's planned peak holds the working set once (the ILP's `node_working`);
        # the simulator holds it during each pass, so it is no micro-batch's to keep.
        kept = max(stage.memory_bytes - state - working, 0.0) / max(stage.in_flight, 1)
    # The op-by-op peaks (`planner/intra/liveness.py`) beyond what the stage holds per
    # micro-batch: its kept activations, or under recomputation only its layers' inputs,
    # the replay bringing back the rest during the backward. Plans without them: none.
    extra = {k: max(p.predicted.get(k, 0.0) - held, 0.0) for k, held in (
        ("forward_peak_bytes", full), ("backward_peak_bytes", kept),
        ("backward_held_peak_bytes", kept))}
    return TaskCost(forward_s=forward, backward_s=backward, update_s=update,
                    state_bytes=state, activation_bytes=kept,
                    working_bytes=working,
                    grad_bytes=p.predicted.get("grad_bytes", 0.0),
                    forward_extra_bytes=extra["forward_peak_bytes"],
                    backward_extra_bytes=extra["backward_peak_bytes"],
                    backward_held_extra_bytes=extra["backward_held_peak_bytes"])


def replay_s(p: Plan) -> float:
    """Seconds of one micro-batch's forward that ``p`` runs again in backward (a plan of an
    older meshplan recomputes its whole forward)."""
    return p.predicted.get("replay_s", p.predicted["forward_s"]) if p.recompute else 0.0


@dataclass(frozen=True)
class TransferCosts:
    """Seconds each SEND of a pipeline takes (module docstring), from ``plan.transfers``."""

    cluster: Cluster
    microbatches: int
    transfers: tuple[TransferEntry, ...]

    def __post_init__(self) -> None:
        # Messages by (sending, receiving) stage, and SEND times once computed: a pipeline's
        # program repeats the same few SENDs once per micro-batch.
        by_pair: dict[tuple, list[TransferEntry]] = defaultdict(list)
        for t in self.transfers:
            by_pair[tuple(t.stages)].append(t)
        object.__setattr__(self, "_by_pair", dict(by_pair))
        object.__setattr__(self, "_memo", {})

    def send_s(self, ins: Instruction) -> float:
        """One SEND instruction: stage ``ins.stage``'s ``ins.kind`` values of one micro-batch
        to stage ``ins.peer``."""
        key = (ins.stage, ins.peer, ins.kind)
        if key not in self._memo:
            kinds = (ins.kind, "gather")
            msgs = [t for t in self._by_pair.get(key[:2], ()) if t.kind in kinds]
            self._memo[key] = self._busiest(msgs, 1.0 / self.microbatches)
        return self._memo[key]

    def tied_s(self) -> float:
        """The step's tied-gradient messages (once per step, at the update)."""
        return self._busiest([t for t in self.transfers if t.kind == "tied"], 1.0)

    def _busiest(self, msgs: list[TransferEntry], share: float) -> float:
        c = self.cluster
        per_link: dict[tuple, float] = defaultdict(float)   # bytes each link carries
        for t in msgs:
            nbytes = t.bytes * t.count * share
            src, dst = t.src // c.devices_per_host, t.dst // c.devices_per_host
            if src == dst:
                per_link[(c.intra_host, "device", t.src)] += nbytes
            else:
                per_link[(c.inter_host, "out", src)] += nbytes
                per_link[(c.inter_host, "in", dst)] += nbytes
        return max((link.latency + nbytes / link.effective_bandwidth
                    for (link, *_), nbytes in per_link.items()), default=0.0)
