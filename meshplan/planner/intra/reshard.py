"""Resharding recipes: the collectives that turn one layout into another, forward and backward.

`reshard_steps` is the single source of truth for what moves between two ops. The ILP charges
its cost, the plan lists its collectives, and lowering emits exactly these steps — so the cost
model charges what runs, and tests can compare the runtime's record with the plan.

Order of a recipe: reduce pending partial sums (all-reduce, or reduce-scatter straight into a
split the consumer wants); gather splits the consumer does not keep (or move a split from one dim
to another with an all-to-all); cut new splits locally; finally, for axes over which the consumer
divides its work while this tensor is replicated, mark the gradient for an all-reduce in
backward. For a parameter that last mark becomes the update-phase gradient synchronization.

``nbytes`` of a step is DESIGN.md §4's B — the whole tensor involved in that collective, on even
shards: the all-reduced tensor, the gather's output, the reduce-scatter's input, the all-to-all's
total.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshplan.planner.intra.layout import Axes, Layout

FORWARD_KIND = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
                "all_gather": "all_gather", "all_to_all": "all_to_all"}
BACKWARD_KIND = {("all_reduce", "all_reduce"): "all_reduce",
                 ("reduce_scatter", "all_gather"): "all_gather",
                 ("all_gather", "reduce_scatter"): "reduce_scatter",
                 ("all_to_all", "all_to_all"): "all_to_all",
                 ("split", "all_gather"): "all_gather",
                 ("grad_all_reduce", "all_reduce"): "all_reduce"}


@dataclass(frozen=True)
class Step:
    """One resharding action. ``dim`` is the dim gathered, scattered or split (for an all-to-all:
    the dim that loses its split); ``dim2`` the dim an all-to-all splits."""

    op: str
    axes: Axes
    nbytes: int
    backward: str = "none"
    dim: int = -1
    dim2: int = -1

    def collectives(self, needs_grad: bool) -> tuple[tuple[str, str], ...]:
        """(kind, phase) of the collectives this step issues."""
        out = []
        if self.op in FORWARD_KIND:
            out.append((FORWARD_KIND[self.op], "forward"))
        if needs_grad and (self.op, self.backward) in BACKWARD_KIND:
            out.append((BACKWARD_KIND[(self.op, self.backward)], "backward"))
        return tuple(out)


@dataclass(frozen=True)
class Recipe:
    steps: tuple[Step, ...]
    sync_axes: Axes  # parameter roots only: axes of the update-phase gradient synchronization


def _nbytes(global_bytes: int, dims: list[Axes], mesh_shape: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        for a in d:
            n *= mesh_shape[a]
    return global_bytes // n


def _common_prefix(a: Axes, b: Axes) -> Axes:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(x)
    return tuple(out)


@lru_cache(maxsize=None)
def reshard(src: Layout, dst: Layout, global_bytes: int, mesh_shape: tuple[int, ...],
            grad_partial: Axes = (), needs_grad: bool = False, param_root: bool = False
            ) -> Recipe:
    """The recipe turning ``src`` into ``dst`` (see the module docstring)."""
    assert not dst.partial or dst.partial == src.partial, (src, dst)
    cur = list(src.dims)
    steps: list[Step] = []
    pending = set(grad_partial) if needs_grad else set()
    _reduce_partials(src, dst, cur, steps, pending, global_bytes, mesh_shape)
    _gather_and_move(dst, cur, steps, pending, global_bytes, mesh_shape)
    for d, want in enumerate(dst.dims):
        extra = want[len(cur[d]):]
        if extra:
            before = _nbytes(global_bytes, cur, mesh_shape)
            cur[d] = want
            steps.append(Step("split", extra, before, "all_gather", dim=d))
    assert tuple(cur) == dst.dims, (src, dst, cur)
    marks = tuple(sorted(pending))
    if marks and not param_root:
        steps.append(Step("grad_all_reduce", marks, _nbytes(global_bytes, cur, mesh_shape),
                          "all_reduce"))
    return Recipe(tuple(steps), marks if param_root else ())


def _reduce_partials(src: Layout, dst: Layout, cur: list[Axes], steps: list[Step],
                     pending: set[int], global_bytes: int, mesh_shape: tuple[int, ...]) -> None:
    todo = [a for a in src.partial if a not in dst.partial]
    if not todo:
        return
    if len(todo) == 1:
        k = todo[0]
        target = dst.axis_dim(k)
        if target is not None and dst.dims[target] == (k,) and not cur[target]:
            steps.append(Step("reduce_scatter", (k,), _nbytes(global_bytes, cur, mesh_shape),
                              "all_gather", dim=target))
            cur[target] = (k,)
            return
    with_bw = tuple(a for a in todo if a in pending)
    without = tuple(a for a in todo if a not in pending)
    nbytes = _nbytes(global_bytes, cur, mesh_shape)
    if with_bw:
        steps.append(Step("all_reduce", with_bw, nbytes, "all_reduce"))
        pending.difference_update(with_bw)
    if without:
        steps.append(Step("all_reduce", without, nbytes, "identity"))


def _gather_and_move(dst: Layout, cur: list[Axes], steps: list[Step], pending: set[int],
                     global_bytes: int, mesh_shape: tuple[int, ...]) -> None:
    for d in range(len(cur)):
        keep = _common_prefix(cur[d], dst.dims[d])
        drop = cur[d][len(keep):]
        if not drop:
            continue
        if len(drop) == 1 and len(cur[d]) == 1:
            target = dst.axis_dim(drop[0])
            if target is not None and target != d and dst.dims[target] == drop and not cur[target]:
                total = _nbytes(global_bytes, cur, mesh_shape) * mesh_shape[drop[0]]
                steps.append(Step("all_to_all", drop, total, "all_to_all", dim=d, dim2=target))
                cur[d], cur[target] = (), drop
                continue
        groups = [drop] if (set(drop) <= pending or not set(drop) & pending) else \
            [(a,) for a in reversed(drop)]  # mixed: inner axis first, each with its own backward
        for axes in groups:
            cur[d] = cur[d][:len(cur[d]) - len(axes)]
            rs = set(axes) <= pending
            steps.append(Step("all_gather", axes, _nbytes(global_bytes, cur, mesh_shape),
                              "reduce_scatter" if rs else "slice", dim=d))
            if rs:
                pending.difference_update(axes)
