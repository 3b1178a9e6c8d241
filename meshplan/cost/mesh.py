"""The logical 2-D device mesh the planner works on, with latency α and inverse bandwidth β per axis.

Devices are numbered host-major; mesh position (i, j) of an (r, c) mesh is device i·c + j. Axis 1
(the fast axis) groups c consecutive devices, axis 0 groups devices with stride c. An axis whose
groups all stay inside one host uses the cluster's intra-host link, otherwise the inter-host link.

Inter-host bandwidth is per host, and every group of the axis that crosses hosts runs its collective
at the same time as the others, so they share each host's network: with g such groups touching one
host, each gets bandwidth/g (β = g/bandwidth). On a (hosts, 8) mesh, axis 0 has 8 groups per host,
each using one eighth of the host's links — on a DGX A100 exactly one 200 Gb/s NIC per GPU; a ring
over all devices of the cluster shares nothing (g = 1), matching NCCL's multi-ring bus bandwidth.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.cost.checks import check_count, check_nonnegative
from meshplan.cost.cluster import Cluster
from meshplan.cost.devices import Link


def _pair(value: object, what: str) -> tuple[Any, Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{what} must be a pair (axis 0, axis 1), got {value!r}")
    return (value[0], value[1])


def _shape_pair(value: object) -> tuple[int, int]:
    rows, cols = _pair(value, "mesh shape")
    return (check_count(rows, "mesh shape[0]"), check_count(cols, "mesh shape[1]"))


def _cost_pair(value: object, what: str) -> tuple[float, float]:
    first, second = _pair(value, what)
    return (check_nonnegative(first, f"{what}[0]"), check_nonnegative(second, f"{what}[1]"))


@dataclass(frozen=True)
class LogicalMesh:
    """A 2-D logical mesh `shape` = (rows, cols); axis 1 is the fast axis.

    `alpha[k]` is the latency of a collective on axis k (seconds, or abstract units) and `beta[k]`
    its inverse bandwidth (seconds per byte, or abstract units per byte). Sequences are stored as
    tuples so the mesh is hashable. Raises TypeError/ValueError on malformed fields.

    `weights` (HAP's shard ratios; empty: even) gives per axis each position's share of a dim
    split over that axis, stored as fractions summing to 1. Collectives over an uneven axis are
    priced with the uneven formulas of DESIGN.md §4, and `gather_impl` says how uneven shards
    are gathered: "padded" (one all-gather of shards padded to the largest), "broadcast" (one
    broadcast per member) or "auto" (per tensor, whichever is cheaper; `uneven_gather_impl`).
    """

    shape: tuple[int, int]
    alpha: tuple[float, float]
    beta: tuple[float, float]
    weights: tuple[tuple[float, ...], ...] = ()
    gather_impl: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape_pair(self.shape))
        object.__setattr__(self, "alpha", _cost_pair(self.alpha, "alpha"))
        object.__setattr__(self, "beta", _cost_pair(self.beta, "beta"))
        object.__setattr__(self, "weights", _fractions(self.weights, self.shape))
        if self.gather_impl not in GATHER_IMPLS:
            raise ValueError(f"gather_impl must be one of {GATHER_IMPLS}, got "
                             f"{self.gather_impl!r}")

    def __hash__(self) -> int:
        # Remembered: a mesh keys the cost caches (a reshard's collectives, a parameter's
        # synchronization), hashed about once per pair of choices a formulation prices. Of
        # numbers only (the gather by its index, not its name), so the same in every process.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.alpha, self.beta, self.weights,
                      GATHER_IMPLS.index(self.gather_impl)))
            object.__setattr__(self, "_hash", h)
        return h

    def shares(self, axes: Sequence[int]) -> tuple[float, ...]:
        """Each member's fraction of a dim split over ``axes`` (outer axis first, the group's
        member order): products of the axes' weights, or 1/n each on an even mesh."""
        out = [1.0]
        for a in axes:
            w = self.weights[a] if self.weights else (1.0 / self.shape[a],) * self.shape[a]
            out = [x * y for x in out for y in w]
        return tuple(out)

    def is_even(self, axes: Sequence[int]) -> bool:
        """Whether a split over ``axes`` gives every member the same share."""
        return not self.weights or all(len(set(self.weights[a])) == 1 for a in axes)

    @property
    def num_devices(self) -> int:
        """Number of devices, rows × cols."""
        return self.shape[0] * self.shape[1]

    def axis_size(self, axis: int) -> int:
        """Number of devices along mesh axis `axis` (0 or 1); ValueError otherwise."""
        if axis not in (0, 1) or isinstance(axis, bool):
            raise ValueError(f"mesh axis must be 0 or 1, got {axis!r}")
        return self.shape[axis]


GATHER_IMPLS = ("auto", "padded", "broadcast")


def _fractions(weights: object, shape: tuple[int, int]) -> tuple[tuple[float, ...], ...]:
    """Per-axis weights as fractions summing to 1 (empty stays empty: even shares)."""
    if not weights:
        return ()
    if not isinstance(weights, Sequence) or len(weights) != 2:
        raise ValueError(f"mesh weights must give one list per axis (2), got {weights!r}")
    out = []
    for a, w in enumerate(weights):
        if not isinstance(w, Sequence) or len(w) != shape[a]:
            raise ValueError(f"mesh weights[{a}] must list {shape[a]} shares (axis {a} of a "
                             f"{shape} mesh), got {w!r}")
        vals = [check_nonnegative(x, f"mesh weights[{a}]") for x in w]
        if sum(vals) <= 0:
            raise ValueError(f"mesh weights[{a}] must have a positive sum, got {w!r}")
        out.append(tuple(x / sum(vals) for x in vals))
    return tuple(out)


def with_shares(mesh: LogicalMesh, weights: Sequence[Sequence[float]], gather_impl: str = "auto"
                ) -> LogicalMesh:
    """``mesh`` with a plan's shard weights (none, or every axis even: as it is) and its way of
    gathering uneven shards: how the planner priced the plan, for whoever prices it again."""
    if not weights or all(len(set(w)) <= 1 for w in weights):
        return mesh
    return LogicalMesh(mesh.shape, mesh.alpha, mesh.beta, tuple(tuple(w) for w in weights),
                       gather_impl)


def factor_pairs(n: int) -> list[tuple[int, int]]:
    """All (r, c) with r·c = n, r ascending: the valid mesh shapes for n devices."""
    return [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """Parse "RxC" (e.g. "2x4") into (R, C); ValueError naming the text and the expected form."""
    if not isinstance(text, str):
        raise TypeError(f"mesh shape must be a string like '2x4', got {text!r}")
    match = re.fullmatch(r"\s*([1-9]\d*)\s*[xX]\s*([1-9]\d*)\s*", text, re.ASCII)
    if match is None:
        raise ValueError(f"bad mesh shape {text!r}: expected RxC with positive integers, e.g. '2x4'")
    return (int(match.group(1)), int(match.group(2)))


def _axis_groups(shape: tuple[int, int], axis: int) -> list[range]:
    rows, cols = shape
    if axis == 1:
        return [range(i * cols, (i + 1) * cols) for i in range(rows)]
    return [range(j, rows * cols, cols) for j in range(cols)]


def _axis_alpha_beta(cluster: Cluster, shape: tuple[int, int], axis: int) -> tuple[float, float]:
    """(α, β) of mesh axis `axis` on `cluster`: its link, and for inter-host links the sharing."""
    per_host = cluster.devices_per_host
    crossing = [g for g in _axis_groups(shape, axis) if g[0] // per_host != g[-1] // per_host]
    if not crossing:
        return _alpha_beta(cluster.intra_host, 1)
    groups_on_host = [0] * cluster.num_hosts
    for group in crossing:
        for host in {device // per_host for device in group}:
            groups_on_host[host] += 1
    return _alpha_beta(cluster.inter_host, max(groups_on_host))


def _alpha_beta(link: Link, sharing: int) -> tuple[float, float]:
    return (link.latency, sharing / link.effective_bandwidth)


def logical_mesh(
    cluster: Cluster,
    shape: tuple[int, int] | None = None,
    alpha: tuple[float, float] | None = None,
    beta: tuple[float, float] | None = None,
) -> LogicalMesh:
    """View all devices of `cluster` as a mesh of `shape` (default: cluster.default_mesh_shape()).

    α and β per axis come from the links the axis uses (module docstring) unless `alpha` / `beta`
    give both axes explicitly. Raises ValueError if rows × cols != cluster.num_devices, listing
    the valid shapes."""
    shape = cluster.default_mesh_shape() if shape is None else _shape_pair(shape)
    if shape[0] * shape[1] != cluster.num_devices:
        raise ValueError(
            f"mesh shape {shape} has {shape[0] * shape[1]} devices but cluster {cluster.name!r} has "
            f"{cluster.num_devices}; valid shapes: {factor_pairs(cluster.num_devices)}"
        )
    derived = [_axis_alpha_beta(cluster, shape, axis) for axis in (0, 1)]
    return LogicalMesh(
        shape,
        alpha if alpha is not None else (derived[0][0], derived[1][0]),
        beta if beta is not None else (derived[0][1], derived[1][1]),
    )
