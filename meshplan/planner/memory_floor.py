"""A lower bound of any plan's memory per device at a micro-batch count, to skip counts that no
plan could fit without pricing them: the pipeline search's count walk (`inter/search.py`) and
the single-stage walk of `api._plan`.

Summed over all devices, a plan holds every parameter's state once (sharding never shrinks the
total) and, without recomputation, every activation a micro-batch keeps for its backward at
once, at the end of its forward. Recomputed, a stage replays its layers one by one and never
holds them all, so only the state and the batch itself bound it (``recompute``; the pipeline
search prunes by the plain floor anyway: `inter/search.py`).

A count's floor needs the program traced at its micro-batch size; the activations are affine in
the samples per micro-batch, so once two counts are traced the others' are extrapolated, and a
count whose extrapolated floor is well over the budget is skipped without a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.ir.graph import Graph
from meshplan.planner.intra.op_costs import unsharded_bytes

# An extrapolated floor this far over the budget skips its count untraced.
EXTRAPOLATED_MARGIN = 1.1


@dataclass
class CountFloors:
    """Floors per device by micro-batch count. ``trace(b)``: the program at ``b`` micro-batches;
    ``recompute``: whether a plan may recompute (the floor is then the state and the batch)."""

    trace: Callable[[int], Graph]
    dtype: str
    state: OptimizerState
    num_devices: int
    budget: float | None
    recompute: bool = False
    traced: dict[int, float] = field(default_factory=dict)

    def floor(self, b: int) -> float:
        """Bytes per device no plan at ``b`` micro-batches holds less than (traced)."""
        if b not in self.traced:
            graph = with_compute_dtype(self.trace(b), self.dtype)
            state, kept = unsharded_bytes(graph, self.state)
            if self.recompute:
                kept = sum(n.out.nbytes for n in graph.nodes if n.role in ("input", "target"))
            self.traced[b] = (state + kept) / self.num_devices
        return self.traced[b]

    def may_fit(self, b: int) -> bool:
        """Whether a plan at ``b`` micro-batches may fit the budget: its floor does (traced
        unless the extrapolation says it is well over)."""
        if self.budget is None:
            return True
        if self.skips_untraced(b):
            return False
        return self.floor(b) <= self.budget

    def skips_untraced(self, b: int) -> bool:
        """Whether `may_fit` says no to ``b`` micro-batches without tracing them."""
        return b not in self.traced and self._surely_over(b)

    def _surely_over(self, b: int) -> bool:
        """Whether the floor at ``b``, extrapolated from the two fewest counts traced, exceeds
        the budget by `EXTRAPOLATED_MARGIN`."""
        if self.budget is None or len(self.traced) < 2:
            return False
        (b1, f1), (b2, f2) = sorted(self.traced.items())[:2]
        x, x1, x2 = 1 / b, 1 / b1, 1 / b2     # samples per micro-batch, up to the batch size
        guess = f1 + (f2 - f1) * (x - x1) / (x2 - x1)
        return guess > EXTRAPOLATED_MARGIN * self.budget
