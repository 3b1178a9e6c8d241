"""Collective costs (DESIGN.md §4), checked against the ILP objectives of alpa_cases.md."""

from __future__ import annotations

import pytest

from meshplan.cost.collectives import (
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    collective_cost,
    group_size,
    grouped_broadcast_cost,
    padded_all_gather_cost,
    reduce_scatter_cost,
    send_recv_cost,
    uneven_gather_impl,
)
from meshplan.cost.mesh import LogicalMesh

UNIT = (1.0, 1.0)
ROW4 = LogicalMesh((1, 4), UNIT, UNIT)
COL4 = LogicalMesh((4, 1), UNIT, UNIT)
F32 = 4  # bytes per element


def test_unit_all_reduce_values() -> None:
    assert all_reduce_cost(ROW4, (1,), 4096) == 6145
    assert all_reduce_cost(ROW4, (1,), 128) == 193


@pytest.mark.parametrize("mesh", [ROW4, COL4], ids=["1x4", "4x1"])
def test_m1_data_parallel_objective(mesh: LogicalMesh) -> None:
    # 6 layers Linear(32, 32): a 32x32 weight and a 32 bias each, one all-reduce per parameter.
    axis = (0,) if mesh.shape[0] == 4 else (1,)
    per_layer = all_reduce_cost(mesh, axis, 32 * 32 * F32) + all_reduce_cost(mesh, axis, 32 * F32)
    assert 6 * per_layer == 38_028


def test_m2_megatron_objective() -> None:
    assert 5 * all_reduce_cost(ROW4, (1,), 32 * 256 * F32) == 245_765


def test_m4_forced_data_parallel_objective() -> None:
    per_layer = all_reduce_cost(ROW4, (1,), 256 * 256 * F32) + all_reduce_cost(ROW4, (1,), 256 * F32)
    assert 6 * per_layer == 2_368_524


def test_m6_m7_sharded_update_objective() -> None:
    def rs_ag(nbytes: int) -> float:
        return reduce_scatter_cost(ROW4, (1,), nbytes) + all_gather_cost(ROW4, (1,), nbytes)

    assert 6 * (rs_ag(32 * 32 * F32) + rs_ag(32 * F32)) == 38_040


def test_m3_two_axis_objective() -> None:
    mesh = LogicalMesh((2, 2), (1.0, 1.0), (1.0, 0.1))
    total = (
        6 * all_reduce_cost(mesh, (0,), 32 * 32 * F32 / 2)
        + 3 * all_reduce_cost(mesh, (0,), 32 * F32 / 2)
        + 3 * all_reduce_cost(mesh, (0,), 32 * F32)
        + 5 * all_reduce_cost(mesh, (1,), 256 * 32 * F32 / 2)
    )
    assert round(total) == 21_073


@pytest.mark.parametrize(("shape", "expected"), [((4, 8), 26_873), ((8, 4), 58_330)])
def test_p5_objective(shape: tuple[int, int], expected: int) -> None:
    mesh = LogicalMesh(shape, (1.0, 1.0), (1.0, 0.01))
    m0, m1 = shape
    hidden, batch = 128, 1024
    total = 2 * all_reduce_cost(mesh, (0,), hidden * hidden * F32 / m1) + all_reduce_cost(
        mesh, (1,), batch * hidden * F32 / m0
    )
    assert round(total) == expected


@pytest.mark.parametrize(
    ("count", "nbytes", "expected"),
    [
        (2, 128 * 128 * F32, 196_610),  # P1: one gradient all-reduce per 128x128 weight
        (1, 128 * 1024 * F32, 786_433),  # P2: one activation all-reduce, batch 128 x hidden 1024
        (12, 65_536, 1_179_660),  # P3
        (11, 524_288, 8_650_763),  # P4
    ],
)
def test_p1_to_p4_objectives(count: int, nbytes: int, expected: int) -> None:
    assert count * all_reduce_cost(ROW4, (1,), nbytes) == expected


def test_formulas_on_general_mesh() -> None:
    mesh = LogicalMesh((2, 4), (3.0, 2.0), (0.5, 0.25))
    assert all_gather_cost(mesh, (1,), 800) == pytest.approx(2 + 150)
    assert reduce_scatter_cost(mesh, (0,), 800) == pytest.approx(3 + 200)
    assert all_to_all_cost(mesh, (1,), 800) == pytest.approx(2 + 37.5)
    assert all_reduce_cost(mesh, (1,), 800) == pytest.approx(2 + 300)
    # both axes: one ring over 8 devices with the larger alpha and beta
    assert all_reduce_cost(mesh, (0, 1), 800) == pytest.approx(3 + 700)
    assert all_reduce_cost(mesh, (1, 0), 800) == all_reduce_cost(mesh, (0, 1), 800)


def test_size_one_axes_cost_nothing_and_are_dropped() -> None:
    mesh = LogicalMesh((1, 4), (5.0, 1.0), (7.0, 1.0))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_cost(kind, mesh, (0,), 1000) == 0.0
        assert collective_cost(kind, mesh, (), 1000) == 0.0
        # axis 0 (size 1) must not contribute its larger alpha and beta
        assert collective_cost(kind, mesh, (0, 1), 1000) == collective_cost(kind, mesh, (1,), 1000)
    assert padded_all_gather_cost(mesh, (0,), [100]) == 0.0
    assert grouped_broadcast_cost(mesh, (), [100]) == 0.0


def test_group_size() -> None:
    mesh = LogicalMesh((2, 4), UNIT, UNIT)
    assert [group_size(mesh, axes) for axes in [(), (0,), (1,), (0, 1)]] == [1, 2, 4, 8]


def test_send_recv_cost() -> None:
    assert send_recv_cost(1e-5, 1e-9, 1e6) == pytest.approx(1e-5 + 1e-3)
    with pytest.raises(ValueError, match="beta"):
        send_recv_cost(1.0, -1.0, 10)


def test_uneven_shard_costs() -> None:
    mesh = LogicalMesh((1, 4), UNIT, (1.0, 2.0))
    shards = [10, 30, 20, 20]
    assert padded_all_gather_cost(mesh, (1,), shards) == 1 + 3 * 30 * 2
    assert grouped_broadcast_cost(mesh, (1,), shards) == 4 * 1 + 80 * 2
    # even shards: the padded all-gather equals the plain all-gather of the whole tensor
    assert padded_all_gather_cost(mesh, (1,), [20] * 4) == all_gather_cost(mesh, (1,), 80)
    with pytest.raises(ValueError, match="shard_bytes has 3 entries; the group over axes \\(1,\\) has 4"):
        padded_all_gather_cost(mesh, (1,), [1, 2, 3])


def test_collective_cost_dispatch_and_errors() -> None:
    assert collective_cost("all_reduce", ROW4, (1,), 4096) == all_reduce_cost(ROW4, (1,), 4096)
    assert collective_cost("all_to_all", ROW4, (1,), 4096) == all_to_all_cost(ROW4, (1,), 4096)
    with pytest.raises(ValueError, match=r"unknown collective kind 'broadcast'; valid kinds: \['all_gather'"):
        collective_cost("broadcast", ROW4, (1,), 10)


@pytest.mark.parametrize(
    ("axes", "nbytes", "error", "match"),
    [
        ((2,), 10, ValueError, "axes must be one of"),
        ((0, 0), 10, ValueError, "axes must be one of"),
        ((0, 1.0), 10, ValueError, "axes must be one of"),
        ((True,), 10, ValueError, "axes must be one of"),
        ("01", 10, TypeError, "axes must be a tuple"),
        ((1,), -1, ValueError, "nbytes"),
        ((1,), float("inf"), ValueError, "nbytes"),
        ((1,), "10", TypeError, "nbytes"),
    ],
)
def test_bad_arguments(axes: object, nbytes: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        all_reduce_cost(ROW4, axes, nbytes)  # type: ignore[arg-type]


# HAP's uneven shards (DESIGN.md §4): a (1, 4) mesh whose axis 1 carries 0.4/0.3/0.2/0.1, with
# large axis-0 figures that must not count (axis 0 has size 1). On axis 1: α = 2, β = 0.5.
RATIOS = (0.4, 0.3, 0.2, 0.1)


def uneven(impl: str = "auto", weights: tuple[float, ...] = RATIOS) -> LogicalMesh:
    return LogicalMesh((1, 4), (5.0, 2.0), (9.0, 0.5), weights=((1.0,), weights), gather_impl=impl)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_uneven_gather_is_the_cheaper_of_padded_and_broadcast(kind: str) -> None:
    mesh = uneven()
    # B = 40: padded α + 3·(0.4·40)·β = 26 beats broadcast 4α + 40·β = 28.
    assert uneven_gather_impl(mesh, (1,), 40) == "padded"
    assert collective_cost(kind, mesh, (1,), 40) == pytest.approx(2 + 3 * 16 * 0.5)
    # B = 400: padded 2 + 3·160·0.5 = 242 loses to broadcast 8 + 400·0.5 = 208.
    assert uneven_gather_impl(mesh, (1,), 400) == "broadcast"
    assert collective_cost(kind, mesh, (1,), 400) == pytest.approx(4 * 2 + 400 * 0.5)
    # The formulas agree with the per-shard functions on the shards 0.4B, 0.3B, 0.2B, 0.1B.
    shards = [r * 400 for r in RATIOS]
    assert padded_all_gather_cost(mesh, (1,), shards) == pytest.approx(242)
    assert grouped_broadcast_cost(mesh, (1,), shards) == pytest.approx(208)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_a_forced_gather_impl_is_obeyed_even_when_dearer(kind: str) -> None:
    assert uneven_gather_impl(uneven("padded"), (1,), 400) == "padded"
    assert collective_cost(kind, uneven("padded"), (1,), 400) == pytest.approx(242)
    assert uneven_gather_impl(uneven("broadcast"), (1,), 40) == "broadcast"
    assert collective_cost(kind, uneven("broadcast"), (1,), 40) == pytest.approx(28)


def test_a_tie_goes_to_the_padded_gather() -> None:
    # shares 0.5/0.25/0.25/0 (a zero share is allowed): padded 1 + 3·0.5·6 = 10 = 4·1 + 6.
    mesh = LogicalMesh((1, 4), UNIT, UNIT, weights=((1.0,), (2, 1, 1, 0)))
    assert padded_all_gather_cost(mesh, (1,), [3, 1.5, 1.5, 0]) == grouped_broadcast_cost(
        mesh, (1,), [3, 1.5, 1.5, 0]) == 10
    assert uneven_gather_impl(mesh, (1,), 6) == "padded"
    assert all_gather_cost(mesh, (1,), 6) == 10


def test_uneven_all_to_all_pads_every_piece_to_the_largest() -> None:
    # α + (n−1)·max_share²·B·β = 2 + 3·0.16·400·0.5, whatever gather_impl says.
    for impl in ("auto", "padded", "broadcast"):
        assert all_to_all_cost(uneven(impl), (1,), 400) == pytest.approx(2 + 3 * 0.16 * 400 * 0.5)


def test_uneven_all_reduce_is_the_even_ring() -> None:
    assert all_reduce_cost(uneven(), (1,), 400) == pytest.approx(2 + 1.5 * 400 * 0.5)
    assert all_reduce_cost(uneven(), (1,), 400) == all_reduce_cost(uneven(weights=(1, 1, 1, 1)),
                                                                    (1,), 400)


@pytest.mark.parametrize("impl", ["auto", "padded", "broadcast"])
def test_even_weights_give_the_ring_formulas(impl: str) -> None:
    even, plain = uneven(impl, (1, 1, 1, 1)), LogicalMesh((1, 4), (5.0, 2.0), (9.0, 0.5))
    assert even.is_even((1,)) and uneven_gather_impl(even, (1,), 400) == "ring"
    for nbytes in (40, 400):
        assert all_gather_cost(even, (1,), nbytes) == pytest.approx(2 + 0.75 * nbytes * 0.5)
        assert reduce_scatter_cost(even, (1,), nbytes) == pytest.approx(2 + 0.75 * nbytes * 0.5)
        assert all_to_all_cost(even, (1,), nbytes) == pytest.approx(2 + 3 / 16 * nbytes * 0.5)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert collective_cost(kind, even, (1,), nbytes) == collective_cost(kind, plain, (1,),
                                                                                nbytes)


def test_uneven_weights_on_one_axis_of_a_two_axis_mesh() -> None:
    # Axis 0 even, axis 1 3:1; over both axes the shares are products 0.375/0.125/0.375/0.125.
    mesh = LogicalMesh((2, 2), UNIT, UNIT, weights=((1, 1), (3, 1)))
    assert mesh.shares((0, 1)) == pytest.approx((0.375, 0.125, 0.375, 0.125))
    assert uneven_gather_impl(mesh, (0,), 8) == "ring"
    assert all_gather_cost(mesh, (0,), 8) == pytest.approx(1 + 0.5 * 8)
    assert all_gather_cost(mesh, (1,), 8) == pytest.approx(1 + 1 * 0.75 * 8)   # padded < 2 + 8
    assert all_gather_cost(mesh, (0, 1), 8) == pytest.approx(1 + 3 * 0.375 * 8)  # padded < 4 + 8
    assert all_to_all_cost(mesh, (0, 1), 8) == pytest.approx(1 + 3 * 0.375**2 * 8)


def test_mesh_weights_are_stored_as_fractions() -> None:
    mesh = LogicalMesh((1, 4), UNIT, UNIT, weights=[[2], [4, 3, 2, 1]])
    assert mesh.weights[0] == (1.0,) and mesh.weights[1] == pytest.approx(RATIOS)
    assert isinstance(mesh.weights[1], tuple)
    assert mesh.shares((1,)) == pytest.approx(RATIOS) and not mesh.is_even((1,))
    assert mesh.is_even((0,)) and hash(mesh) == hash(LogicalMesh((1, 4), UNIT, UNIT,
                                                                 weights=((2,), (4, 3, 2, 1))))
    assert ROW4.shares((1,)) == (0.25,) * 4 and ROW4.is_even((0, 1))


@pytest.mark.parametrize(
    ("weights", "impl", "match"),
    [
        (((1.0,),), "auto", r"mesh weights must give one list per axis \(2\)"),
        (((1.0,), (1, 2, 3)), "auto",
         r"mesh weights\[1\] must list 4 shares \(axis 1 of a \(1, 4\)"),
        (((1.0, 1.0), (1, 1, 1, 1)), "auto", r"mesh weights\[0\] must list 1 shares"),
        (((1.0,), (1, -1, 1, 1)), "auto", r"mesh weights\[1\] must be >= 0, got -1"),
        (((1.0,), (0, 0, 0, 0)), "auto", r"mesh weights\[1\] must have a positive sum"),
        ((), "ring", r"gather_impl must be one of \('auto', 'padded', 'broadcast'\), got 'ring'"),
        (((1.0,), RATIOS), "Padded", r"gather_impl must be one of .*got 'Padded'"),
    ],
)
def test_bad_mesh_weights_and_gather_impl(weights: object, impl: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LogicalMesh((1, 4), UNIT, UNIT, weights=weights, gather_impl=impl)  # type: ignore[arg-type]
