"""Autograd-aware collectives: forward and backward of each rank against a single-process
reference program (plain torch ops over every rank's tensors), plus the records they leave."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from meshplan.runtime import collectives as C
from meshplan.runtime.comm import IMPLS, CollectiveRecord, Comm
from meshplan.runtime.emulated import run_emulated
from uneven_impls import COPY_KEYS, SUM_KEYS, impl_program, oracle

Mesh = tuple[int, int]
Axes = tuple[int, ...]
Tensors = list[torch.Tensor]
MESHES = [(1, 2), (2, 1), (1, 4), (2, 2)]
AXES = [(0,), (1,), (0, 1)]
F32 = 4  # bytes


def members(mesh: Mesh, rank: int, axes: Axes) -> list[int]:
    """Independent oracle: ranks whose coords agree with mine off ``axes``, in rank order."""
    r, c = mesh
    mine = divmod(rank, c)
    fixed = [a for a in (0, 1) if a not in axes]
    return [q for q in range(r * c) if all(divmod(q, c)[a] == mine[a] for a in fixed)]


def groups_of(mesh: Mesh, axes: Axes) -> list[list[int]]:
    return [members(mesh, r, axes) for r in range(mesh[0] * mesh[1])]


def uneven(n: int) -> list[int]:
    return {1: [4], 2: [3, 1], 4: [2, 0, 3, 1]}[n]


def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def expected_records(
    mesh: Mesh, axes: Axes, n: int, *entries: tuple[str, int, str], impl: str = "padded"
) -> list[CollectiveRecord]:
    """Records of ``entries``; ``impl`` applies to the all-gathers and reduce-scatters."""
    norm = tuple(a for a in axes if mesh[a] > 1)
    if n == 1:
        return []
    return [
        CollectiveRecord(kind, nbytes, norm, phase,
                         impl if kind in ("all_gather", "reduce_scatter") else "padded")
        for kind, nbytes, phase in entries
    ]


def run_local(
    mesh: Mesh, xs: Tensors, ws: Tensors, op: Callable[[Comm, torch.Tensor], torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, list[CollectiveRecord]]]:
    """Per rank: y = op(x), backward of sum(y * w); returns (y, x.grad, records)."""

    def body(comm: Comm) -> tuple[torch.Tensor, torch.Tensor, list[CollectiveRecord]]:
        x = xs[comm.rank].clone().requires_grad_()
        y = op(comm, x)
        (y * ws[comm.rank]).sum().backward()
        return y.detach(), x.grad, comm.records

    return run_emulated(body, mesh)


def reference_grads(xs: Tensors, loss: Callable[[Tensors], torch.Tensor]) -> Tensors:
    leaves = [x.clone().requires_grad_() for x in xs]
    loss(leaves).backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("backward", ["identity", "all_reduce"])
def test_all_reduce(mesh: Mesh, axes: Axes, backward: str) -> None:
    group = groups_of(mesh, axes)
    num = len(group)
    xs = [rand((3, 4), r) for r in range(num)]
    # identity backward assumes replicated downstream work: one weight per group (its leader's).
    ws = [rand((3, 4), 100 + (group[r][0] if backward == "identity" else r)) for r in range(num)]
    out = run_local(mesh, xs, ws, lambda c, x: C.all_reduce(c, x, axes, backward=backward))

    def global_loss(leaves: Tensors) -> torch.Tensor:
        counted = [r for r in range(num) if backward == "all_reduce" or group[r][0] == r]
        return sum((sum(leaves[m] for m in group[r]) * ws[r]).sum() for r in counted)

    grads = reference_grads(xs, global_loss)
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, sum(xs[m] for m in group[r]))
        torch.testing.assert_close(g, grads[r])
        back = [("all_reduce", 48, "backward")] if backward == "all_reduce" else []
        entries = [("all_reduce", 48, "forward"), *back]
        assert records == expected_records(mesh, axes, len(group[r]), *entries)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_grad_all_reduce(mesh: Mesh, axes: Axes) -> None:
    group = groups_of(mesh, axes)
    xs = [rand((2, 5), g[0]) for g in group]  # replicated within the group
    ws = [rand((2, 5), 100 + r) for r in range(len(group))]  # split work downstream
    out = run_local(mesh, xs, ws, lambda c, x: C.grad_all_reduce(c, x, axes))
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, xs[r], rtol=0, atol=0)
        # d(sum of the members' losses)/dX for the one logical X of the group.
        torch.testing.assert_close(g, sum(ws[m] for m in group[r]))
        entries = [("all_reduce", 40, "backward")]
        assert records == expected_records(mesh, axes, len(group[r]), *entries)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("backward", ["slice", "reduce_scatter"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
def test_all_gather(mesh: Mesh, axes: Axes, backward: str, dim: int, impl: str) -> None:
    group = groups_of(mesh, axes)
    num = len(group)
    xs = [rand((uneven(len(g))[g.index(r)], 3), r).movedim(0, dim) for r, g in enumerate(group)]

    def gathered(leaves: Tensors, r: int) -> torch.Tensor:
        return torch.cat([leaves[m] for m in group[r]], dim)

    # slice backward assumes replicated downstream work: one weight per group.
    wseed = [g[0] if backward == "slice" else r for r, g in enumerate(group)]
    ws = [rand(tuple(gathered(xs, r).shape), 100 + wseed[r]) for r in range(num)]
    out = run_local(
        mesh, xs, ws,
        lambda c, x: C.all_gather(
            c, x, axes, dim, uneven(c.group_size(axes)), backward=backward, impl=impl
        ),
    )

    def global_loss(leaves: Tensors) -> torch.Tensor:
        counted = [r for r in range(num) if backward == "reduce_scatter" or group[r][0] == r]
        return sum((gathered(leaves, r) * ws[r]).sum() for r in counted)

    grads = reference_grads(xs, global_loss)
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, gathered(xs, r), rtol=0, atol=0)
        torch.testing.assert_close(g, grads[r])
        nbytes = F32 * 3 * sum(uneven(len(group[r])))
        back = [("reduce_scatter", nbytes, "backward")] if backward == "reduce_scatter" else []
        entries = [("all_gather", nbytes, "forward"), *back]
        assert records == expected_records(mesh, axes, len(group[r]), *entries, impl=impl)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
def test_reduce_scatter(mesh: Mesh, axes: Axes, dim: int, impl: str) -> None:
    group = groups_of(mesh, axes)
    num = len(group)
    xs = [rand((6, 2), r).movedim(0, dim) for r in range(num)]
    sizes = [{1: [6], 2: [1, 5], 4: [3, 0, 1, 2]}[len(g)] for g in group]

    def mine(leaves: Tensors, r: int) -> torch.Tensor:
        total = sum(leaves[m] for m in group[r])
        return torch.split(total, sizes[r], dim)[group[r].index(r)]

    ws = [rand(tuple(mine(xs, r).shape), 100 + r) for r in range(num)]
    out = run_local(
        mesh, xs, ws, lambda c, x: C.reduce_scatter(c, x, axes, dim, sizes[c.rank], impl=impl)
    )
    grads = reference_grads(xs, lambda ls: sum((mine(ls, r) * ws[r]).sum() for r in range(num)))
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, mine(xs, r))
        torch.testing.assert_close(g, grads[r])
        entries = [("reduce_scatter", 48, "forward"), ("all_gather", 48, "backward")]
        assert records == expected_records(mesh, axes, len(group[r]), *entries, impl=impl)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("backward", ["all_gather", "none"])
def test_split(mesh: Mesh, axes: Axes, backward: str) -> None:
    group = groups_of(mesh, axes)
    num = len(group)
    sizes = [uneven(len(g)) for g in group]
    xs = [rand((3, sum(sizes[r])), g[0]) for r, g in enumerate(group)]  # one logical X per group
    leaders = sorted({g[0] for g in group})

    def piece(leaves: Tensors, r: int) -> torch.Tensor:
        return C.local_slice(leaves[r], 1, sizes[r], group[r].index(r))

    ws = [rand(tuple(piece(xs, r).shape), 100 + r) for r in range(num)]
    out = run_local(
        mesh, xs, ws, lambda c, x: C.split(c, x, axes, 1, sizes[c.rank], backward=backward)
    )

    def global_loss(logical: Tensors) -> torch.Tensor:
        per_rank = [logical[leaders.index(g[0])] for g in group]
        return sum((piece(per_rank, r) * ws[r]).sum() for r in range(num))

    logical_grads = reference_grads([xs[q] for q in leaders], global_loss)
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, piece(xs, r), rtol=0, atol=0)
        whole = logical_grads[leaders.index(group[r][0])]
        if backward == "all_gather":
            torch.testing.assert_close(g, whole)
        else:  # partial: my piece in place, zeros elsewhere; the members' partials sum to whole
            padded = torch.zeros_like(xs[r])
            C.local_slice(padded, 1, sizes[r], group[r].index(r)).copy_(ws[r])
            torch.testing.assert_close(g, padded, rtol=0, atol=0)
            torch.testing.assert_close(sum(out[m][1] for m in group[r]), whole)
        gather = [("all_gather", F32 * 3 * sum(sizes[r]), "backward")]
        entries = gather if backward == "all_gather" else []
        assert records == expected_records(mesh, axes, len(group[r]), *entries)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("axes", AXES)
def test_all_to_all(mesh: Mesh, axes: Axes) -> None:
    group = groups_of(mesh, axes)
    num = len(group)
    rows = [uneven(len(g)) for g in group]  # S(0) before: member m holds rows[m] of dim 0
    cols = [{1: [5], 2: [4, 1], 4: [1, 2, 0, 2]}[len(g)] for g in group]  # S(2) after
    xs = [rand((rows[r][g.index(r)], 2, 5), r) for r, g in enumerate(group)]

    def moved(leaves: Tensors, r: int) -> torch.Tensor:
        me = group[r].index(r)
        return torch.cat([torch.split(leaves[m], cols[r], 2)[me] for m in group[r]], 0)

    ws = [rand(tuple(moved(xs, r).shape), 100 + r) for r in range(num)]
    out = run_local(
        mesh, xs, ws, lambda c, x: C.all_to_all(c, x, axes, 2, cols[c.rank], 0, rows[c.rank])
    )
    grads = reference_grads(xs, lambda ls: sum((moved(ls, r) * ws[r]).sum() for r in range(num)))
    for r, (y, g, records) in enumerate(out):
        torch.testing.assert_close(y, moved(xs, r), rtol=0, atol=0)
        torch.testing.assert_close(g, grads[r], rtol=0, atol=0)
        nbytes = F32 * sum(rows[r]) * 2 * 5
        entries = [("all_to_all", nbytes, "forward"), ("all_to_all", nbytes, "backward")]
        assert records == expected_records(mesh, axes, len(group[r]), *entries)


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)])
def test_broadcast_impl_is_bitwise_the_padded_one(mesh: Mesh) -> None:
    """Sizes [4, 3, 2, 1] and [2, 0, 3, 1] on 4 ranks, forward and backward: both impls give
    the oracle's gathers exactly and its member-order sums bitwise (the emulation sums a
    reduce and a reduce-scatter alike in member order), hence bitwise each other."""
    want = oracle(4)
    runs = {impl: run_emulated(impl_program, mesh, impl) for impl in IMPLS}
    for impl, results in runs.items():
        for rank, got in enumerate(results):
            for key in COPY_KEYS + SUM_KEYS:
                assert torch.equal(got[key], want[rank][key]), f"{impl} rank {rank} {key}"
            assert {r.impl for r in got["records"]} == {impl}
    for padded, broadcast in zip(runs["padded"], runs["broadcast"]):
        assert [(r.kind, r.nbytes, r.axes, r.phase) for r in padded["records"]] == [
            (r.kind, r.nbytes, r.axes, r.phase) for r in broadcast["records"]
        ]


def test_bad_impl_names_valid_ones() -> None:
    calls = [
        lambda comm: C.all_gather(comm, torch.ones(2), (1,), 0, [2, 2], impl="ring"),
        lambda comm: C.reduce_scatter(comm, torch.ones(4), (1,), 0, [2, 2], impl="ring"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="'padded', 'broadcast'"):
            run_emulated(call, (1, 2))


def test_shard_sizes_match_tensor_split() -> None:
    for size in range(0, 9):
        for n in range(1, 6):
            expected = [p.shape[0] for p in torch.tensor_split(torch.empty(size), n)]
            assert C.shard_sizes(size, n) == expected
    with pytest.raises(ValueError):
        C.shard_sizes(4, 0)


def test_local_slice_picks_uneven_piece() -> None:
    t = torch.arange(12).reshape(2, 6)
    assert torch.equal(C.local_slice(t, 1, [1, 3, 2], 1), t[:, 1:4])
    with pytest.raises(ValueError):
        C.local_slice(t, 1, [1, 3], 0)
    with pytest.raises(ValueError):
        C.local_slice(t, 2, [2], 0)


def test_bad_backward_choice_names_valid_ones() -> None:
    def body(comm: Comm) -> None:
        C.all_gather(comm, torch.ones(2), (1,), 0, [2, 2], backward="gather")

    with pytest.raises(ValueError, match="reduce_scatter"):
        run_emulated(body, (1, 2))


def test_megatron_mlp_matches_single_process() -> None:
    """The f / g pair around a column- then row-parallel MLP on 2 ranks equals the unsharded MLP."""
    x, w1, w2 = rand((4, 6), 1), rand((6, 8), 2), rand((8, 3), 3)

    def body(comm: Comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        sizes, me = C.shard_sizes(8, 2), comm.group_index((1,))
        a = C.local_slice(w1, 1, sizes, me).clone().requires_grad_()
        b = C.local_slice(w2, 0, sizes, me).clone().requires_grad_()
        xi = x.clone().requires_grad_()
        h = torch.relu(C.grad_all_reduce(comm, xi, (1,)) @ a)
        y = C.all_reduce(comm, h @ b, (1,), backward="identity")
        (y**2).sum().backward()
        return y.detach(), xi.grad, torch.cat([a.grad, b.grad.T], 0), comm.records

    ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
    y_ref = torch.relu(ref[0] @ ref[1]) @ ref[2]
    (y_ref**2).sum().backward()
    weight_grads = torch.cat([ref[1].grad, ref[2].grad.T], 0)
    for me, (y, gx, gw, records) in enumerate(run_emulated(body, (1, 2))):
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, ref[0].grad)
        torch.testing.assert_close(gw, C.local_slice(weight_grads, 1, [4, 4], me))
        assert [(r.kind, r.nbytes, r.phase) for r in records] == [
            ("all_reduce", 48, "forward"),
            ("all_reduce", 96, "backward"),
        ]
