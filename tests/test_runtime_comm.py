"""Comm interface over the in-process emulation: groups, uneven shards, records, failures."""

from __future__ import annotations

import time

import pytest
import torch

from meshplan.runtime.comm import CollectiveRecord, Comm
from meshplan.runtime.emulated import run_emulated

MESHES = [(1, 2), (2, 1), (1, 4), (2, 2)]
AXES = [(0,), (1,), (0, 1)]


def members(mesh: tuple[int, int], rank: int, axes: tuple[int, ...]) -> list[int]:
    """Independent oracle: ranks whose coords agree with mine off ``axes``, in rank order."""
    r, c = mesh
    mine = divmod(rank, c)
    fixed = [a for a in (0, 1) if a not in axes]
    return [q for q in range(r * c) if all(divmod(q, c)[a] == mine[a] for a in fixed)]


def norm(mesh: tuple[int, int], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a for a in axes if mesh[a] > 1)


def uneven(n: int) -> list[int]:
    """Uneven sizes, not in tensor_split order, with a zero when n = 4."""
    return {1: [4], 2: [3, 1], 4: [2, 0, 3, 1]}[n]


def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mesh", MESHES)
def test_groups_follow_row_major_mesh(mesh: tuple[int, int]) -> None:
    def body(comm: Comm) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(comm.group_size(a), comm.group_index(a), comm.group_ranks(a)) for a in AXES]

    for rank, got in enumerate(run_emulated(body, mesh)):
        for axes, (size, index, ranks) in zip(AXES, got):
            expected = members(mesh, rank, axes)
            assert ranks == tuple(expected) and size == len(expected)
            assert index == expected.index(rank)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_all_reduce_sums_group_and_records(mesh: tuple[int, int], axes: tuple[int, ...]) -> None:
    def body(comm: Comm) -> tuple[torch.Tensor, list[CollectiveRecord]]:
        x = rand((3, 5), comm.rank)
        return comm.all_reduce(x, axes, phase="update"), comm.records

    out = run_emulated(body, mesh)
    for rank, (y, records) in enumerate(out):
        group = members(mesh, rank, axes)
        expected = torch.stack([rand((3, 5), m) for m in group]).sum(0)
        torch.testing.assert_close(y, expected)
        # Deterministic: every member holds bitwise the same sum.
        assert all(torch.equal(y, out[m][0]) for m in group)
        want = [CollectiveRecord("all_reduce", 60, norm(mesh, axes), "update")]
        assert records == (want if len(group) > 1 else [])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_uneven(mesh: tuple[int, int], axes: tuple[int, ...], dim: int) -> None:
    def shard(rank: int, size: int) -> torch.Tensor:
        return rand((size, 2), rank).movedim(0, dim) if dim else rand((size, 2), rank)

    def body(comm: Comm) -> tuple[torch.Tensor, list[CollectiveRecord]]:
        sizes = uneven(comm.group_size(axes))
        x = shard(comm.rank, sizes[comm.group_index(axes)])
        return comm.all_gather(x, axes, dim, sizes, phase="forward"), comm.records

    for rank, (y, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        sizes = uneven(len(group))
        expected = torch.cat([shard(m, s) for m, s in zip(group, sizes)], dim=dim)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        want = [CollectiveRecord("all_gather", 4 * 2 * sum(sizes), norm(mesh, axes), "forward")]
        assert records == (want if len(group) > 1 else [])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_uneven(mesh: tuple[int, int], axes: tuple[int, ...], dim: int) -> None:
    def full(rank: int) -> torch.Tensor:
        return rand((3, 6), rank) if dim else rand((6, 3), rank)

    def cut(n: int) -> list[int]:
        return {1: [6], 2: [5, 1], 4: [2, 0, 3, 1]}[n]

    def body(comm: Comm) -> tuple[torch.Tensor, list[CollectiveRecord]]:
        sizes = cut(comm.group_size(axes))
        y = comm.reduce_scatter(full(comm.rank), axes, dim, sizes, phase="backward")
        return y, comm.records

    for rank, (y, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        sizes = cut(len(group))
        total = torch.stack([full(m) for m in group]).sum(0)
        expected = torch.split(total, sizes, dim=dim)[group.index(rank)]
        torch.testing.assert_close(y, expected)
        want = [CollectiveRecord("reduce_scatter", 4 * 18, norm(mesh, axes), "backward")]
        assert records == (want if len(group) > 1 else [])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("pass_concat_sizes", [True, False])
def test_all_to_all_uneven(
    mesh: tuple[int, int], axes: tuple[int, ...], pass_concat_sizes: bool
) -> None:
    # Local input: dim 0 is my shard of a sharded dim (uneven), dim 2 is whole and gets split.
    def local(rank: int, rows: int) -> torch.Tensor:
        return rand((rows, 2, 5), rank)

    def body(comm: Comm) -> tuple[torch.Tensor, list[CollectiveRecord]]:
        n, me = comm.group_size(axes), comm.group_index(axes)
        rows, cols = uneven(n), {1: [5], 2: [1, 4], 4: [0, 2, 2, 1]}[n]
        extra = {"concat_sizes": rows} if pass_concat_sizes else {}
        y = comm.all_to_all(local(comm.rank, rows[me]), axes, 2, cols, 0, phase="forward", **extra)
        return y, comm.records

    for rank, (y, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        n, me = len(group), group.index(rank)
        rows, cols = uneven(n), {1: [5], 2: [1, 4], 4: [0, 2, 2, 1]}[n]
        pieces = [torch.split(local(m, rows[k]), cols, dim=2)[me] for k, m in enumerate(group)]
        torch.testing.assert_close(y, torch.cat(pieces, dim=0), rtol=0, atol=0)
        want = [CollectiveRecord("all_to_all", 4 * sum(rows) * 2 * 5, norm(mesh, axes), "forward")]
        assert records == (want if n > 1 else [])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("dim", [0, 1])
def test_resplit_moves_the_cut(mesh: tuple[int, int], axes: tuple[int, ...], dim: int) -> None:
    """A piece cut by one set of sizes re-cut by another (segment boundaries, HAP §5.2): every
    member ends with exactly its new rows of the whole tensor, and the gradient goes back."""
    from meshplan.runtime.collectives import resplit

    def cuts(n: int) -> tuple[list[int], list[int]]:
        return {1: ([6], [6]), 2: ([5, 1], [2, 4]), 4: ([2, 0, 3, 1], [1, 3, 0, 2])}[n]

    whole = rand((6, 3), 7) if dim == 0 else rand((3, 6), 7)

    def body(comm: Comm) -> tuple[torch.Tensor, torch.Tensor, list[CollectiveRecord]]:
        n, me = comm.group_size(axes), comm.group_index(axes)
        old, new = cuts(n)
        x = torch.split(whole, old, dim=dim)[me].clone().requires_grad_(True)
        y = resplit(comm, x, axes, dim, old, new)
        (y * (me + 1)).sum().backward()
        return y.detach(), x.grad, comm.records

    for rank, (y, grad, records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        n, me = len(group), group.index(rank)
        old, new = cuts(n)
        torch.testing.assert_close(y, torch.split(whole, new, dim=dim)[me], rtol=0, atol=0)
        # d(sum_m (m+1) * new piece m)/d(my old piece): each row weighted by its new owner + 1.
        owner = torch.repeat_interleave(torch.arange(n), torch.tensor(new)).to(whole.dtype) + 1
        shape = (-1, 1) if dim == 0 else (1, -1)
        expect = torch.split(owner.view(shape).expand_as(whole), old, dim=dim)[me]
        torch.testing.assert_close(grad, expect)
        want = [CollectiveRecord("resplit", 4 * 18, norm(mesh, axes), p)
                for p in ("forward", "backward")]
        assert records == (want if n > 1 and old != new else [])


def test_size_one_axes_are_identity_and_record_nothing() -> None:
    def body(comm: Comm) -> list[bool]:
        x = torch.ones(2, 3)
        outs = [
            comm.all_reduce(x, (0,), phase="forward"),
            comm.all_gather(x, (0,), 1, [3], phase="forward"),
            comm.reduce_scatter(x, (), 1, [3], phase="forward"),
            comm.all_to_all(x, (0,), 1, [3], 0, phase="forward"),
        ]
        return [o is x for o in outs] + [comm.records == []]

    for result in run_emulated(body, (1, 2)):
        assert all(result)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c, x: c.all_reduce(x, (2,), phase="forward"), ValueError),
        (lambda c, x: c.all_reduce(x, (1, 1), phase="forward"), ValueError),
        (lambda c, x: c.all_reduce(x, 1, phase="forward"), TypeError),
        (lambda c, x: c.all_reduce(x, (1,), phase="sideways"), ValueError),
        (lambda c, x: c.all_reduce([1.0], (1,), phase="forward"), TypeError),
        (lambda c, x: c.all_gather(x, (1,), 0, [4], phase="forward"), ValueError),
        (lambda c, x: c.all_gather(x, (1,), 0, [4, 3], phase="forward"), ValueError),
        (lambda c, x: c.all_gather(x, (1,), 2, [4, 4], phase="forward"), ValueError),
        (lambda c, x: c.reduce_scatter(x, (1,), 0, [2, 1], phase="forward"), ValueError),
        (lambda c, x: c.reduce_scatter(x, (1,), 0, [5, -1], phase="forward"), ValueError),
        (lambda c, x: c.all_to_all(x, (1,), 0, [2, 2], 0, phase="forward"), ValueError),
        (lambda c, x: c.all_to_all(x, (1,), 1, [1, 1], 0, phase="forward"), ValueError),
        (lambda c, x: c.all_gather(x, (1,), 0, [4, 4], phase="forward", impl="ring"), ValueError),
        (lambda c, x: c.reduce_scatter(x, (1,), 0, [2, 2], phase="forward", impl=""), ValueError),
        # Checked even where the collective is the identity (size-1 axis).
        (lambda c, x: c.all_gather(x, (0,), 0, [4], phase="forward", impl="ring"), ValueError),
    ],
)
def test_bad_arguments_raise(call: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        run_emulated(lambda comm: call(comm, torch.ones(4, 3)), (1, 2))


def test_record_rejects_unknown_kind_and_phase() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        CollectiveRecord("broadcast", 4, (0,), "forward")
    with pytest.raises(ValueError, match="later"):
        CollectiveRecord("all_reduce", 4, (0,), "later")


def test_record_impl_is_for_gathers_and_scatters_only() -> None:
    assert CollectiveRecord("all_gather", 4, (0,), "forward").impl == "padded"
    assert CollectiveRecord("reduce_scatter", 4, (0,), "forward", "broadcast").impl == "broadcast"
    with pytest.raises(ValueError, match="all_reduce"):
        CollectiveRecord("all_reduce", 4, (0,), "forward", "broadcast")
    with pytest.raises(ValueError, match="valid impls"):
        CollectiveRecord("all_gather", 4, (0,), "forward", "ring")


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_broadcast_impl_matches_padded_bitwise(
    mesh: tuple[int, int], axes: tuple[int, ...]
) -> None:
    """Comm level, every group shape: the broadcast impl gives the padded impl's bits (the
    emulation sums a reduce in member order, like its reduce-scatter) and records the same
    kind and bytes."""
    def body(comm: Comm) -> tuple[list[torch.Tensor], list[CollectiveRecord]]:
        sizes = uneven(comm.group_size(axes))
        shard = rand((sizes[comm.group_index(axes)], 3), comm.rank)
        full = rand((3, sum(sizes)), 50 + comm.rank)
        outs = []
        for impl in ("padded", "broadcast"):
            outs.append(comm.all_gather(shard, axes, 0, sizes, phase="forward", impl=impl))
            outs.append(comm.reduce_scatter(full, axes, 1, sizes, phase="forward", impl=impl))
        return outs, comm.records

    for rank, ((ag, rs, ag_b, rs_b), records) in enumerate(run_emulated(body, mesh)):
        group = members(mesh, rank, axes)
        sizes, me = uneven(len(group)), group.index(rank)
        expected = torch.cat([rand((s, 3), m) for m, s in zip(group, sizes)])
        assert torch.equal(ag, expected) and torch.equal(ag_b, ag)
        total = sum(rand((3, sum(sizes)), 50 + m) for m in group)
        torch.testing.assert_close(rs, torch.split(total, sizes, dim=1)[me])
        assert torch.equal(rs_b, rs), f"rank {rank}"
        ax = norm(mesh, axes)
        kinds = [("all_gather", 4 * 3 * sum(sizes)), ("reduce_scatter", 4 * 3 * sum(sizes))]
        want = [CollectiveRecord(k, b, ax, "forward", impl)
                for impl in ("padded", "broadcast") for k, b in kinds]
        assert records == (want if len(group) > 1 else [])


def test_bad_mesh_shape_raises() -> None:
    with pytest.raises(ValueError, match="mesh_shape"):
        run_emulated(lambda comm: None, (0, 2))
    with pytest.raises(ValueError, match="mesh_shape"):
        run_emulated(lambda comm: None, (2, 2, 2))


def test_failing_rank_is_reraised_with_its_rank_and_others_fail_fast() -> None:
    def body(comm: Comm) -> None:
        comm.all_reduce(torch.ones(2), (0, 1), phase="forward")
        if comm.rank == 2:
            raise KeyError("rank two broke")
        comm.all_reduce(torch.ones(2), (0, 1), phase="forward")  # the others wait here

    start = time.perf_counter()
    with pytest.raises(KeyError, match="rank two broke") as info:
        run_emulated(body, (2, 2), timeout_s=20.0)
    assert time.perf_counter() - start < 5.0  # aborted, not timed out
    assert any("rank 2" in note for note in info.value.__notes__)


def test_missing_member_times_out() -> None:
    def body(comm: Comm) -> None:
        if comm.rank != 0:
            comm.all_reduce(torch.ones(2), (1,), phase="forward")

    with pytest.raises(TimeoutError, match="timed out"):
        run_emulated(body, (1, 2), timeout_s=0.2)


def test_mismatched_collectives_are_detected() -> None:
    def body(comm: Comm) -> None:
        if comm.rank == 0:
            comm.all_reduce(torch.ones(2), (1,), phase="forward")
        else:
            comm.all_gather(torch.ones(2), (1,), 0, [2, 2], phase="forward")

    with pytest.raises(RuntimeError, match="mismatch"):
        run_emulated(body, (1, 2), timeout_s=5.0)


def test_rows_run_independently() -> None:
    # Row 0 issues two collectives while row 1 issues one: groups must not share a rendezvous.
    def body(comm: Comm) -> float:
        x = torch.full((1,), float(comm.rank))
        x = comm.all_reduce(x, (1,), phase="forward")
        if comm.rank < 2:
            x = comm.all_reduce(x, (1,), phase="forward")
        return float(x)

    assert run_emulated(body, (2, 2), timeout_s=5.0) == [2.0, 2.0, 5.0, 5.0]


def test_emulation_is_fast() -> None:
    def body(comm: Comm) -> torch.Tensor:
        x = torch.ones(64)
        for k in range(100):
            x = comm.all_reduce(x, AXES[k % 3], phase="forward") * 0.5
        return x

    start = time.process_time()   # CPU seconds of all ranks: a busy machine's wall clock is
    results = run_emulated(body, (2, 2))   # no measure
    elapsed = time.process_time() - start
    assert all(torch.equal(results[0], r) for r in results)
    assert elapsed < 1.0, f"100 collectives on 4 emulated ranks took {elapsed:.3f} s"
