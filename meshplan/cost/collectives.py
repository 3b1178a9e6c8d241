"""α-β costs of collectives on a logical mesh (DESIGN.md §4).

`axes` is a tuple of mesh axes: (), (0,), (1,) or (0, 1). `nbytes` (B) is the size of the whole
tensor involved: the all-gather's output, the reduce-scatter's input, the all-reduced tensor. On a
group of n devices with latency α and inverse bandwidth β:

    all-reduce                   α + 2(n−1)/n · B · β
    all-gather, reduce-scatter   α + (n−1)/n · B · β
    all-to-all                   α + (n−1)/n² · B · β
    send/recv                    α + B · β

On a mesh with uneven `weights` (HAP's shard ratios), shards ``s_i = share_i · B`` differ:
all-gather and reduce-scatter cost the cheaper of a padded collective ``α + (n−1)·max s_i·β``
and a grouped broadcast (reduce) ``n·α + Σ s_i·β`` (`uneven_gather_impl`, unless the mesh fixes
one), all-to-all pads every piece to the largest, ``α + (n−1)·max share²·B·β``; an all-reduce
moves the whole tensor in even chunks whatever the shards.

Axes of size 1 are dropped; with none of size > 1 left the cost is 0. Two axes of size > 1 form one
ring over all n0·n1 devices with the larger α and the larger β. Costs are in the units of α and β
(seconds when the mesh comes from a Cluster).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from meshplan.cost.checks import check_nonnegative
from meshplan.cost.mesh import LogicalMesh


def _check_axes(mesh: LogicalMesh, axes: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(mesh, LogicalMesh):
        raise TypeError(f"mesh must be a LogicalMesh, got {mesh!r}")
    if isinstance(axes, (str, bytes)) or not isinstance(axes, Sequence):
        raise TypeError(f"axes must be a tuple of mesh axes, one of (), (0,), (1,), (0, 1); got {axes!r}")
    if not all(type(a) is int for a in axes) or tuple(sorted(axes)) not in ((), (0,), (1,), (0, 1)):
        raise ValueError(f"axes must be one of (), (0,), (1,), (0, 1); got {axes!r}")
    return tuple(sorted(axes))


def group_size(mesh: LogicalMesh, axes: Sequence[int]) -> int:
    """Number of devices in one collective group over `axes` (1 for ()). Raises on bad axes."""
    return math.prod(mesh.shape[a] for a in _check_axes(mesh, axes))


def _ring(mesh: LogicalMesh, axes: Sequence[int]) -> tuple[int, float, float]:
    """(n, α, β) of the ring over `axes` after dropping size-1 axes; n = 1 means no collective."""
    live = [a for a in _check_axes(mesh, axes) if mesh.shape[a] > 1]
    if not live:
        return (1, 0.0, 0.0)
    n = math.prod(mesh.shape[a] for a in live)
    return (n, max(mesh.alpha[a] for a in live), max(mesh.beta[a] for a in live))


def _ring_cost(
    mesh: LogicalMesh, axes: Sequence[int], nbytes: float, factor: Callable[[int], float]
) -> float:
    size = check_nonnegative(nbytes, "nbytes")
    n, alpha, beta = _ring(mesh, axes)
    return 0.0 if n == 1 else alpha + factor(n) * size * beta


def all_reduce_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """α + 2(n−1)/n·B·β for all-reducing a tensor of `nbytes` bytes over `axes`."""
    return _ring_cost(mesh, axes, nbytes, lambda n: 2 * (n - 1) / n)


def _live(mesh: LogicalMesh, axes: Sequence[int]) -> tuple[int, ...]:
    return tuple(a for a in _check_axes(mesh, axes) if mesh.shape[a] > 1)


def uneven_gather_impl(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> str:
    """How a tensor of `nbytes` split over `axes` is gathered (or reduce-scattered): "ring"
    when the shards are even, else the mesh's fixed `gather_impl`, or under "auto" the cheaper
    of "padded" and "broadcast" (ties go to "padded": one collective, not n)."""
    live = _live(mesh, axes)
    if not live or mesh.is_even(live):
        return "ring"
    if mesh.gather_impl != "auto":
        return mesh.gather_impl
    shards = [s * nbytes for s in mesh.shares(live)]
    padded = padded_all_gather_cost(mesh, live, shards)
    return "padded" if padded <= grouped_broadcast_cost(mesh, live, shards) else "broadcast"


def _gather_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    impl = uneven_gather_impl(mesh, axes, check_nonnegative(nbytes, "nbytes"))
    if impl == "ring":
        return _ring_cost(mesh, axes, nbytes, lambda n: (n - 1) / n)
    live = _live(mesh, axes)
    shards = [s * nbytes for s in mesh.shares(live)]
    cost = padded_all_gather_cost if impl == "padded" else grouped_broadcast_cost
    return cost(mesh, live, shards)


def all_gather_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """α + (n−1)/n·B·β for all-gathering into an output of `nbytes` bytes over `axes` (uneven
    shards: the module docstring)."""
    return _gather_cost(mesh, axes, nbytes)


def reduce_scatter_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """α + (n−1)/n·B·β for reduce-scattering an input of `nbytes` bytes over `axes` (uneven
    shards: the module docstring; the twin of the all-gather, priced alike)."""
    return _gather_cost(mesh, axes, nbytes)


def all_to_all_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """α + (n−1)/n²·B·β: each device sends (n−1)/n of its B/n bytes (no Alpa n/2 penalty);
    with uneven shares every piece is padded to the largest, share_max² · B."""
    live = _live(mesh, axes)
    if not live or mesh.is_even(live):
        return _ring_cost(mesh, axes, nbytes, lambda n: (n - 1) / n**2)
    top = max(mesh.shares(live))
    return _ring_cost(mesh, axes, nbytes, lambda n: (n - 1) * top * top)


def resplit_cost(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """α + max share · B · β for re-cutting a tensor of ``nbytes`` split over ``axes`` into
    ``mesh``'s shares (`Comm.resplit`, between model segments): one all-to-all of variable
    pieces in which each device receives at most its new share. (What it sends is at most its
    old share, which the other segment's ratios set; the receiving side is priced.)"""
    live = _live(mesh, axes)
    if not live:
        return 0.0
    top = max(mesh.shares(live)) if not mesh.is_even(live) else 1 / group_size(mesh, live)
    return _ring_cost(mesh, axes, nbytes, lambda n: top)


def send_recv_cost(alpha: float, beta: float, nbytes: float) -> float:
    """α + B·β for one point-to-point transfer of `nbytes` bytes over a link (α, β)."""
    for name, value in (("alpha", alpha), ("beta", beta)):
        check_nonnegative(value, name)
    return alpha + check_nonnegative(nbytes, "nbytes") * beta


def _check_shards(mesh: LogicalMesh, axes: Sequence[int], shard_bytes: Sequence[float]) -> list[float]:
    if isinstance(shard_bytes, (str, bytes)) or not isinstance(shard_bytes, Sequence):
        raise TypeError(f"shard_bytes must be a sequence of byte counts, got {shard_bytes!r}")
    n = group_size(mesh, axes)
    if len(shard_bytes) != n:
        raise ValueError(
            f"shard_bytes has {len(shard_bytes)} entries; the group over axes {tuple(axes)} has {n}"
        )
    return [check_nonnegative(s, "shard_bytes entry") for s in shard_bytes]


def padded_all_gather_cost(mesh: LogicalMesh, axes: Sequence[int], shard_bytes: Sequence[float]) -> float:
    """Uneven shards s_i (one per device of the group) gathered by padding each to the largest:
    α + (n−1)·max(s_i)·β (HAP §2.5). Raises ValueError if len(shard_bytes) != group size."""
    shards = _check_shards(mesh, axes, shard_bytes)
    n, alpha, beta = _ring(mesh, axes)
    return 0.0 if n == 1 else alpha + (n - 1) * max(shards) * beta


def grouped_broadcast_cost(mesh: LogicalMesh, axes: Sequence[int], shard_bytes: Sequence[float]) -> float:
    """Uneven shards s_i gathered by one broadcast per device: n·α + Σ s_i·β (HAP §2.5).
    Raises ValueError if len(shard_bytes) != group size."""
    shards = _check_shards(mesh, axes, shard_bytes)
    n, alpha, beta = _ring(mesh, axes)
    return 0.0 if n == 1 else n * alpha + sum(shards) * beta


_KINDS: Mapping[str, Callable[[LogicalMesh, Sequence[int], float], float]] = MappingProxyType(
    {
        "all_reduce": all_reduce_cost,
        "all_gather": all_gather_cost,
        "reduce_scatter": reduce_scatter_cost,
        "all_to_all": all_to_all_cost,
        "resplit": resplit_cost,
    }
)


def collective_cost(kind: str, mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """Cost of collective `kind` (all_reduce, all_gather, reduce_scatter, all_to_all) of `nbytes`
    bytes over `axes`; ValueError naming the kind and the valid kinds."""
    if kind not in _KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {sorted(_KINDS)}")
    return _KINDS[kind](mesh, axes, nbytes)
