"""Cross-mesh resharding plans (`lower/cross_mesh.py`): every layout pair among R, S0, S1, S01
(and partial sources) between the meshes of Alpa's test, executed on arrays, moves values
exactly; local all-gather never moves more bytes between meshes, and each distinct tile crosses
once."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from meshplan.lower.cross_mesh import MeshRanks, ReshardPlan, plan_reshard, tiles
from meshplan.planner.intra.layout import Layout

MESHES = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2)]
DIM_AXES = [(), (0,), (1,), (0, 1)]


def _layouts(shape: tuple[int, int], ndim: int = 2) -> list[Layout]:
    """Every layout of a 2-D value over the mesh's axes (no axis used twice), R / S0 / S1 / S01
    per dim; axes of size 1 are left out (the same layout as without them)."""
    out = []
    for dims in itertools.product(DIM_AXES, repeat=ndim):
        used = [a for d in dims for a in d]
        if len(used) == len(set(used)):
            out.append(Layout(tuple(dims)))
    return out


def _slice(box):
    return tuple(slice(a, b) for a, b in box)


def _execute(plan: ReshardPlan, value: np.ndarray, src: MeshRanks, src_layout: Layout,
             dst: MeshRanks) -> dict[int, np.ndarray]:
    """Run the plan on arrays: sources hold their tiles (a partial source: its member's share
    of the value), receivers place or sum what arrives, then the local all-gathers."""
    src_tiles = tiles(value.shape, src_layout, src)
    members = math.prod(src.shape[a] for a in src_layout.partial)
    local = {}
    for position, rank in enumerate(src.ranks):
        coords = src.coords(position)
        member = 0
        for a in src_layout.partial:
            member = member * src.shape[a] + coords[a]
        part = value * (member + 1) * 2 / (members * (members + 1))   # shares summing to value
        local[rank] = part[_slice(src_tiles[rank])]
    out = {r: np.zeros([b - a for a, b in box]) for r, box in plan.dst_tiles.items()}
    filled = {r: np.zeros(out[r].shape, dtype=np.int64) for r in out}
    for t in plan.transfers:
        origin = src_tiles[t.src]
        piece = local[t.src][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(t.box, origin))]
        base = plan.dst_tiles[t.dst]
        where = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(t.box, base))
        if t.summed:
            out[t.dst][where] += piece
        else:
            out[t.dst][where] = piece
        filled[t.dst][where] += 1
    for g in plan.gathers:
        whole = np.concatenate([out[r][_slice_along(plan.dst_tiles[r], g, k)]
                                for k, r in enumerate(g.ranks)], axis=g.dim)
        for r in g.ranks:
            out[r] = whole.copy()
            filled[r][...] = members
    for r, f in filled.items():   # every element arrived once per partial member
        assert (f == members).all(), (r, f)
    return out


def _slice_along(box, g, k):
    """Rank k's slice of a local-gather tile, in its local indices."""
    lo = box[g.dim][0]
    idx = [slice(None)] * len(box)
    idx[g.dim] = slice(g.cuts[k] - lo, g.cuts[k + 1] - lo)
    return tuple(idx)


@pytest.mark.parametrize("src_shape,dst_shape", list(itertools.product(MESHES, MESHES)))
@pytest.mark.parametrize("per_host", [None, 2])
def test_every_layout_pair_moves_exactly(src_shape, dst_shape, per_host) -> None:
    """``per_host`` 2: the destination's ranks on hosts of two, whose replicas gather apart."""
    value = np.arange(7 * 6, dtype=np.float64).reshape(7, 6) + 1.0  # 7 rows: uneven pieces
    src = MeshRanks(src_shape, tuple(range(math.prod(src_shape))))
    dst = MeshRanks(dst_shape, tuple(range(100, 100 + math.prod(dst_shape))))
    for src_layout, dst_layout in itertools.product(_layouts(src_shape), _layouts(dst_shape)):
        sources = [src_layout] + [Layout(src_layout.dims, p) for p in ((0,), (1,))
                                  if p[0] not in src_layout.split_axes]
        for s in sources:
            plans = {lg: plan_reshard(value.shape, 8, src, s, dst, dst_layout, local_gather=lg,
                                      devices_per_host=per_host)
                     for lg in (False, True)}
            want = tiles(value.shape, dst_layout, dst)
            for plan in plans.values():
                got = _execute(plan, value, src, s, dst)
                for r, box in want.items():
                    np.testing.assert_allclose(got[r], value[_slice(box)], rtol=1e-12)
            assert plans[True].cross_bytes <= plans[False].cross_bytes
            for g in plans[True].gathers:   # a gather never leaves its host
                assert len({r // (per_host or 1000) for r in g.ranks}) == 1, g.ranks
            if not s.partial:   # each distinct tile crosses once into each host holding it
                count = Counter((box, r // (per_host or 1000)) for r, box in want.items())
                once = sum(8 * math.prod(b - a for a, b in box) *
                           (1 if max(b - a for a, b in box) >= n else n)
                           for (box, _), n in count.items())
                assert plans[True].cross_bytes == once


def test_replicas_on_several_hosts_gather_host_by_host() -> None:
    """A tile replicated on four hosts of eight crosses the network once into each host and is
    gathered inside it: the bytes into a host are one tile, not the 6 tiles a gather across
    the hosts would move (each device's missing three quarters)."""
    value_shape, itemsize = (64, 32), 4
    src = MeshRanks((8, 1), tuple(range(8)))                  # host 0
    dst = MeshRanks((32, 1), tuple(range(8, 40)))             # hosts 1-4
    whole = Layout(((), ()))
    plan = plan_reshard(value_shape, itemsize, src, whole, dst, whole, devices_per_host=8)
    tile = itemsize * math.prod(value_shape)
    into = Counter()
    for t in plan.transfers:
        into[t.dst // 8] += t.nbytes
    for g in plan.gathers:
        extent = [b - a for a, b in g.box]
        for k, r in enumerate(g.ranks):
            piece = itemsize * math.prod(extent) // extent[g.dim] * (g.cuts[k + 1] - g.cuts[k])
            for other in g.ranks:
                if other // 8 != r // 8:
                    into[other // 8] += piece
    assert dict(into) == {h: tile for h in (1, 2, 3, 4)}
    assert [sorted({r // 8 for r in g.ranks}) for g in plan.gathers] == [[1], [2], [3], [4]]


def test_replicas_share_the_sending() -> None:
    """A replicated source spreads its transfers over its replicas."""
    src = MeshRanks((1, 4), (0, 1, 2, 3))
    dst = MeshRanks((1, 4), (4, 5, 6, 7))
    plan = plan_reshard((8, 8), 4, src, Layout(((), ())), dst, Layout(((1,), ())),
                        local_gather=False)
    assert sorted(t.src for t in plan.transfers) == [0, 1, 2, 3]


def test_bad_layouts_are_refused() -> None:
    mesh = MeshRanks((1, 2), (0, 1))
    with pytest.raises(ValueError, match="partial"):
        plan_reshard((4,), 4, mesh, Layout(((),)), MeshRanks((1, 2), (2, 3)),
                     Layout(((),), (1,)))
    with pytest.raises(ValueError, match="dims"):
        plan_reshard((4, 4), 4, mesh, Layout(((),)), MeshRanks((1, 2), (2, 3)),
                     Layout(((), ())))
    with pytest.raises(ValueError, match="distinct ranks"):
        MeshRanks((1, 2), (0, 0))


@pytest.mark.parametrize("shape", MESHES)
def test_tiles_are_the_runtimes_shards(shape) -> None:
    """A rank's tile is the piece the single-stage runtime gives it (`take_local`), uneven
    weights included."""
    import torch

    from meshplan.lower.shards import MeshPos, source_sharded, take_local
    weights = (tuple(float(i + 1) for i in range(shape[0])),
               tuple(float(2 * i + 1) for i in range(shape[1])))
    value = torch.arange(13 * 11, dtype=torch.float64).reshape(13, 11)
    mesh = MeshRanks(shape, tuple(range(10, 10 + math.prod(shape))), weights)
    for layout in _layouts(shape):
        boxes = tiles(value.shape, layout, mesh)
        for position, rank in enumerate(mesh.ranks):
            pos = MeshPos(shape, position, weights)
            want = take_local(value, source_sharded(tuple(value.shape), layout, pos), pos)
            assert torch.equal(value[_slice(boxes[rank])], want), (layout, position)
