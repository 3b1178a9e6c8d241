"""LogicalMesh validation, shape parsing, and α/β derived from a cluster's links."""

from __future__ import annotations

import pytest

from meshplan.cost.cluster import local_cluster, preset_cluster
from meshplan.cost.devices import link_preset
from meshplan.cost.mesh import LogicalMesh, factor_pairs, logical_mesh, parse_mesh_shape


def test_mesh_basics_and_hashability() -> None:
    mesh = LogicalMesh([2, 4], [1, 1], [1, 0.1])  # type: ignore[arg-type]
    assert mesh.shape == (2, 4) and mesh.beta == (1.0, 0.1)
    assert mesh.num_devices == 8
    assert (mesh.axis_size(0), mesh.axis_size(1)) == (2, 4)
    assert mesh == LogicalMesh((2, 4), (1.0, 1.0), (1.0, 0.1))
    assert len({mesh, LogicalMesh((2, 4), (1.0, 1.0), (1.0, 0.1))}) == 1


@pytest.mark.parametrize(
    ("shape", "alpha", "beta", "error", "match"),
    [
        ((0, 4), (1, 1), (1, 1), ValueError, "shape"),
        ((2, 4, 1), (1, 1), (1, 1), TypeError, "shape"),
        ((2.0, 4), (1, 1), (1, 1), TypeError, "shape"),
        ((2, 4), (1,), (1, 1), TypeError, "alpha"),
        ((2, 4), (1, -1), (1, 1), ValueError, "alpha"),
        ((2, 4), (1, 1), (1, float("nan")), ValueError, "beta"),
        ((2, 4), (1, 1), ("1", 1), TypeError, "beta"),
    ],
)
def test_mesh_validation(shape: object, alpha: object, beta: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        LogicalMesh(shape, alpha, beta)  # type: ignore[arg-type]


def test_axis_size_rejects_bad_axis() -> None:
    with pytest.raises(ValueError, match="0 or 1, got 2"):
        LogicalMesh((2, 2), (1, 1), (1, 1)).axis_size(2)


@pytest.mark.parametrize(("text", "shape"), [("2x4", (2, 4)), (" 1X8 ", (1, 8)), ("16x1", (16, 1))])
def test_parse_mesh_shape(text: str, shape: tuple[int, int]) -> None:
    assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize("text", ["8", "2x", "2x4x1", "0x4", "-2x4", "axb", ""])
def test_parse_mesh_shape_errors(text: str) -> None:
    with pytest.raises(ValueError, match=f"bad mesh shape {text!r}: expected RxC"):
        parse_mesh_shape(text)


def test_factor_pairs() -> None:
    assert factor_pairs(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert factor_pairs(7) == [(1, 7), (7, 1)]


def test_logical_mesh_default_shape_and_links() -> None:
    cluster = preset_cluster("p3.16xlarge", 2)
    mesh = logical_mesh(cluster)
    nvlink, ethernet = link_preset("nvlink-v100"), link_preset("25gbe")
    assert mesh.shape == (2, 8)
    assert mesh.alpha == (ethernet.latency, nvlink.latency)
    # 8 axis-0 groups share each host's 25 Gb/s: each ring gets 1/8 of it.
    assert mesh.beta == pytest.approx((8 / ethernet.effective_bandwidth,
                                       1 / nvlink.effective_bandwidth))


def test_logical_mesh_wrong_size_lists_valid_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2, 2\) has 4 devices.*has 8; valid shapes: \[\(1, 8\), \(2, 4\)"):
        logical_mesh(local_cluster(8), (2, 2))


def test_single_host_axes_are_intra() -> None:
    nvlink = link_preset("nvlink3")
    for shape in factor_pairs(8):
        mesh = logical_mesh(preset_cluster("dgx-a100", 1), shape)
        assert mesh.alpha == (nvlink.latency, nvlink.latency)
        assert mesh.beta == (1 / nvlink.effective_bandwidth, 1 / nvlink.effective_bandwidth)


@pytest.mark.parametrize(
    ("shape", "axis0", "axis1"),
    [
        # (hosts, 8): axis 1 inside a host, axis 0 across hosts with 8 groups per host
        ((2, 8), ("dgx-a100-ib", 8), ("nvlink3", 1)),
        # one ring over all 16 devices crosses hosts but shares nothing
        ((1, 16), ("nvlink3", 1), ("dgx-a100-ib", 1)),
        ((16, 1), ("dgx-a100-ib", 1), ("nvlink3", 1)),
        # axis 1 of 4 stays in a host; axis 0 (stride 4) has 4 groups on each host
        ((4, 4), ("dgx-a100-ib", 4), ("nvlink3", 1)),
        ((8, 2), ("dgx-a100-ib", 2), ("nvlink3", 1)),
    ],
)
def test_two_dgx_hosts_axis_links(
    shape: tuple[int, int], axis0: tuple[str, int], axis1: tuple[str, int]
) -> None:
    mesh = logical_mesh(preset_cluster("dgx-a100", 2), shape)
    for axis, (name, sharing) in enumerate((axis0, axis1)):
        link = link_preset(name)
        assert mesh.alpha[axis] == link.latency
        assert mesh.beta[axis] == pytest.approx(sharing / link.effective_bandwidth)


def test_axis_one_not_dividing_host_is_inter_host() -> None:
    # 3 hosts x 2 devices viewed as (2, 3): group {0,1,2} spans hosts 0 and 1.
    cluster = preset_cluster("dgx-a100", 3, 2)
    mesh = logical_mesh(cluster, (2, 3))
    ib = link_preset("dgx-a100-ib")
    assert mesh.alpha[1] == ib.latency
    # host 1 holds devices 2 and 3, one from each axis-1 group
    assert mesh.beta[1] == pytest.approx(2 / ib.effective_bandwidth)


def test_explicit_alpha_beta_override_both_axes() -> None:
    mesh = logical_mesh(local_cluster(4), (2, 2), alpha=(1, 1), beta=(1, 0.1))
    assert mesh == LogicalMesh((2, 2), (1.0, 1.0), (1.0, 0.1))
    only_alpha = logical_mesh(local_cluster(4), (1, 4), alpha=(3.0, 3.0))
    assert only_alpha.alpha == (3.0, 3.0)
    assert only_alpha.beta == pytest.approx((1 / 5e9, 1 / 5e9))
