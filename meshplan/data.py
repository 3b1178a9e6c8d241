"""Rank-local loading: each rank reads only the samples of each global batch it computes on.

Every rank may be handed the whole global batch and take its share (the default); for big
inputs (Wide-ResNet's 1536 images at 224², 0.9 GB a step) that reads N times what is used.
`rank_rows` says which rows of a global batch a rank computes on, from the plan alone: the
split of dim 0 of the batch tensors the plan records (`Plan.sources`), cut as the runtime cuts
them (`lower/shards.cut`, uneven shares included), in each of the plan's micro-batches; in a
pipeline, only the ranks whose stages read a batch tensor read anything, and only those
tensors. `LocalBatchSampler` turns that into a `torch.utils.data` batch sampler (its
``tensors``: which of each sample's tensors the rank reads, `rank_tensors`), and
``parallelize(..., local_batches=True)`` takes what it loads: a batch of the rank's rows,
holding the tensors it reads (a dict without the others, or None in their place); a rank that
reads none passes None.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from meshplan.lower.shards import MeshPos, cut, even_weights
from meshplan.plan.plan import Plan
from meshplan.planner.intra.layout import Layout


def _loaded(stage: Plan) -> list:
    """The sources of a stage plan that come from the batch (in a pipeline a stage's other
    inputs are received from earlier stages; a plan saved before sources were named: all)."""
    named = [s for s in stage.sources if s.name]
    return named if named or not stage.sources else list(stage.sources)


def stages_of(plan: Plan, rank: int) -> list[tuple[Plan, int]]:
    """The single-stage plans ``rank`` runs that read a batch tensor, each with the rank's
    index in that plan's mesh: the plan itself, or in a pipeline its stages on the rank's
    mesh that read one (none for a middle stage's ranks)."""
    if plan.num_stages <= 1:
        return [(plan, rank)]
    return [(s.plan, list(s.devices).index(rank)) for s in plan.stages
            if rank in s.devices and s.plan is not None and _loaded(s.plan)]


def stage_of(plan: Plan, rank: int) -> tuple[Plan, int] | None:
    """The first of `stages_of` (None when the rank's stages read no batch tensor)."""
    found = stages_of(plan, rank)
    return found[0] if found else None


def _stage_rows(stage: Plan, local: int, per: int) -> dict[str, list[int]]:
    """Per batch tensor a stage reads (its plan node), the rows of a micro-batch of ``per``
    rows its rank ``local`` computes on."""
    pos = MeshPos(tuple(stage.mesh_shape), local,
                  stage.axis_weights or even_weights(tuple(stage.mesh_shape)))
    out = {}
    for s in _loaded(stage):
        if s.spec == "scalar":
            continue
        axes = Layout.parse(s.spec, s.spec.count(",") + 1).dims[0]
        if not axes:
            out[s.node] = list(range(per))
            continue
        sizes = cut(per, axes, pos.weights)
        i = pos.index(axes)
        out[s.node] = list(range(sum(sizes[:i]), sum(sizes[:i + 1])))
    return out


def _per_micro(plan: Plan, batch_size: int) -> int:
    if batch_size % plan.microbatches:
        raise ValueError(f"{plan.microbatches} micro-batches do not divide a batch of "
                         f"{batch_size}")
    return batch_size // plan.microbatches


def micro_rows(plan: Plan, rank: int, batch_size: int) -> dict[str, list[int]]:
    """Per batch tensor (its plan node), the rows of one micro-batch of a global batch of
    ``batch_size`` that ``rank`` computes on (every row where the plan does not split it); in
    a pipeline over every stage the rank runs (a tensor two stages read: the rows of both)."""
    per = _per_micro(plan, batch_size)
    out: dict[str, set[int]] = {}
    for stage, local in stages_of(plan, rank):
        for node, rows in _stage_rows(stage, local, per).items():
            out.setdefault(node, set()).update(rows)
    return {node: sorted(rows) for node, rows in out.items()}


def rank_tensors(plan: Plan, rank: int) -> tuple[str, ...]:
    """The batch tensors ``rank`` reads, by their names in the batch (``input0``, a keyword,
    ``target``): in a pipeline, only what its stages read (inputs on the first stage's ranks,
    targets on the last's); empty for a middle stage's ranks."""
    names = {s.name or s.node for stage, _ in stages_of(plan, rank) for s in _loaded(stage)}
    return tuple(sorted(names))


def rank_rows(plan: Plan, rank: int, batch_size: int) -> list[int]:
    """The rows of a global batch of ``batch_size`` that ``rank`` reads, in order: what any
    of its batch tensors needs, in every micro-batch (empty for a pipeline rank whose stages
    read no batch tensor)."""
    per_tensor = micro_rows(plan, rank, batch_size)
    rows = sorted({r for rs in per_tensor.values() for r in rs})
    per = batch_size // plan.microbatches
    return [j * per + r for j in range(plan.microbatches) for r in rows]


class LocalBatchSampler:
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) giving ``rank`` its rows of
    each global batch of ``batch_size`` samples: the global batches are consecutive runs of a
    permutation of the dataset (seeded by ``seed`` and the epoch when ``shuffle``), the same
    on every rank, the last incomplete one dropped. ``state_dict`` / ``load_state_dict`` carry
    its position (epoch, step) through a checkpoint."""

    def __init__(self, dataset_size: int, batch_size: int, plan: Plan, rank: int, *,
                 shuffle: bool = False, seed: int = 0) -> None:
        if batch_size < 1 or dataset_size < batch_size:
            raise ValueError(f"a global batch of {batch_size} from {dataset_size} samples: "
                             "give 1 <= batch_size <= the dataset's size")
        self.dataset_size, self.batch_size, self.shuffle, self.seed = \
            dataset_size, batch_size, shuffle, seed
        self.rows = rank_rows(plan, rank, batch_size)
        # What to load of each sample: a pipeline's ranks read only their stages' tensors.
        self.tensors = rank_tensors(plan, rank)
        self.epoch, self.step = 0, 0

    def __len__(self) -> int:
        return self.dataset_size // self.batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        while self.step < len(self):
            start = self.step * self.batch_size
            self.step += 1
            yield [order[start + r] for r in self.rows]
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def local_positions(plan: Plan, rank: int, batch_size: int, stage: Plan | None = None
                    ) -> dict[str, list[int]]:
    """Per batch tensor, which of the rows ``rank`` reads of one micro-batch (`rank_rows`'s
    order) it computes on: a tensor the plan does not split along its rows takes them all.
    ``stage``: one of a pipeline's stage plans the rank runs (its tensors only)."""
    every = micro_rows(plan, rank, batch_size)
    where = {r: k for k, r in enumerate(sorted({r for rs in every.values() for r in rs}))}
    if stage is None:
        per_tensor = every
    else:
        mine = [i for p, i in stages_of(plan, rank) if p is stage]
        per_tensor = _stage_rows(stage, mine[0], _per_micro(plan, batch_size)) if mine else {}
    return {name: [where[r] for r in rs] for name, rs in per_tensor.items()}


__all__ = ["LocalBatchSampler", "local_positions", "rank_rows", "rank_tensors", "stage_of",
           "stages_of"]
