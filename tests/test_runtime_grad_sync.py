"""Bucketed gradient synchronization (phase "update") over emulated ranks."""

from __future__ import annotations

import math

import pytest
import torch

from meshplan.runtime.comm import CollectiveRecord, Comm
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.grad_sync import (all_gather_params, all_reduce_grads, gather_params_into,
                                        reduce_scatter_grads)

MESHES = [(1, 2), (2, 1), (1, 4), (2, 2)]
AXES = [(0,), (1,), (0, 1)]
# Mixed dtypes (two buckets), uneven dim 0 (5 and 3 rows over 2 or 4 members, one empty shard).
SHAPES = [((5, 3), torch.float32), ((7,), torch.float64), ((3, 2, 2), torch.float32)]
FP32_BYTES = (15 + 12) * 4
FP64_BYTES = 7 * 8


def members(mesh: tuple[int, int], rank: int, axes: tuple[int, ...]) -> list[int]:
    r, c = mesh
    mine = divmod(rank, c)
    fixed = [a for a in (0, 1) if a not in axes]
    return [q for q in range(r * c) if all(divmod(q, c)[a] == mine[a] for a in fixed)]


def grads_of(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=gen, dtype=dtype) for shape, dtype in SHAPES]


def summed(group: list[int]) -> list[torch.Tensor]:
    per_rank = [grads_of(m) for m in group]
    return [sum(gs[k] for gs in per_rank) for k in range(len(SHAPES))]


def update_records(
    kind: str, mesh: tuple[int, int], axes: tuple[int, ...], sizes=(FP32_BYTES, FP64_BYTES)
) -> list[CollectiveRecord]:
    """One record per bucket of ``sizes`` bytes: by default one per dtype, in order of first
    appearance (fp32 then fp64)."""
    norm = tuple(a for a in axes if mesh[a] > 1)
    return [CollectiveRecord(kind, nbytes, norm, "update") for nbytes in sizes]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_all_reduce_grads_in_place(mesh: tuple[int, int], axes: tuple[int, ...]) -> None:
    def body(comm: Comm) -> tuple[list[torch.Tensor], list[CollectiveRecord]]:
        grads = grads_of(comm.rank)
        grads[0] = grads[0].t()  # a non-contiguous gradient must be written back in place too
        all_reduce_grads(comm, grads, axes)
        return grads, comm.records

    for rank, (grads, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        expected = summed(group)
        expected[0] = expected[0].t()
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
        assert records == (update_records("all_reduce", mesh, axes) if len(group) > 1 else [])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_reduce_scatter_then_all_gather(mesh: tuple[int, int], axes: tuple[int, ...]) -> None:
    def body(comm: Comm) -> tuple[list[torch.Tensor], list[torch.Tensor], list[CollectiveRecord]]:
        shards = reduce_scatter_grads(comm, grads_of(comm.rank), axes)
        full = all_gather_params(comm, shards, [shape for shape, _ in SHAPES], axes)
        return shards, full, comm.records

    for rank, (shards, full, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        n, me = len(group), group.index(rank)
        for shard, whole, want in zip(shards, full, summed(group)):
            torch.testing.assert_close(shard, torch.tensor_split(want, n, dim=0)[me])
            torch.testing.assert_close(whole, want)
        expected = [*update_records("reduce_scatter", mesh, axes)]
        # Gathered in buckets of at most the largest tensor's bytes (15 fp32 elements), so
        # the fp32 pair goes one at a time.
        expected += update_records("all_gather", mesh, axes, (15 * 4, 12 * 4, FP64_BYTES))
        assert records == (expected if n > 1 else [])


def test_all_gather_params_uses_every_members_shard() -> None:
    # Each member contributes distinct values; the gathered tensor is their dim-0 concatenation.
    def body(comm: Comm) -> torch.Tensor:
        me = comm.group_index((1,))
        rows = torch.tensor_split(torch.arange(10.0).reshape(5, 2), 4, dim=0)[me]
        return all_gather_params(comm, [rows.clone()], [(5, 2)], (1,))[0]

    for full in run_emulated(body, (1, 4)):
        assert torch.equal(full, torch.arange(10.0).reshape(5, 2))


def test_gathering_into_place_holds_one_bucket_at_a_time() -> None:
    """ZeRO-2's update writes each parameter whole in place, a bucket of at most the largest
    tensor at a time: small tensors share one all-gather, a large one goes alone."""
    shapes = [(8, 4), (2, 2), (3, 2), (5, 1)]   # 128 B, then 16 + 24 + 20 = 60 B

    def body(comm: Comm):
        me = comm.group_index((1,))
        whole = [torch.arange(float(math.prod(s))).reshape(s) + k for k, s in enumerate(shapes)]
        mine = [torch.tensor_split(w, 2, dim=0)[me].clone() for w in whole]
        into = [torch.full(s, -1.0) for s in shapes]
        gather_params_into(comm, mine, into, (1,))
        return whole, into, [r.nbytes for r in comm.records]

    for whole, into, sizes in run_emulated(body, (1, 2)):
        assert all(torch.equal(a, b) for a, b in zip(whole, into))
        assert sizes == [128, 60]


def test_bad_inputs_raise() -> None:
    def wrong_shard(comm: Comm) -> None:
        all_gather_params(comm, [torch.zeros(3, 2)], [(5, 2)], (1,))

    with pytest.raises(ValueError, match="shards\\[0\\]"):
        run_emulated(wrong_shard, (1, 2))
    with pytest.raises(ValueError, match="0-dim"):
        run_emulated(lambda comm: reduce_scatter_grads(comm, [torch.tensor(1.0)], (1,)), (1, 2))
    with pytest.raises(TypeError, match="grads\\[1\\]"):
        run_emulated(lambda comm: all_reduce_grads(comm, [torch.ones(1), None], (1,)), (1, 2))
    with pytest.raises(ValueError, match="full_shapes"):
        run_emulated(lambda comm: all_gather_params(comm, [torch.ones(1)], [], (1,)), (1, 2))


def test_empty_list_issues_nothing() -> None:
    def body(comm: Comm) -> list[CollectiveRecord]:
        all_reduce_grads(comm, [], (0, 1))
        assert reduce_scatter_grads(comm, [], (0, 1)) == []
        assert all_gather_params(comm, [], [], (0, 1)) == []
        return comm.records

    assert run_emulated(body, (2, 2)) == [[], [], [], []]
