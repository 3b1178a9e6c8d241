"""Pipelines on a cluster of mixed hosts (HAP's V100 and P100 hosts): which stages run on which
kind of device.

The stage DP works in whole hosts on such a cluster, laid out in an order of their device
types (`stage_problem.DeviceKinds`). A stage whose hosts are all of one type is priced on that
type, so slow devices can get stages of their own with fewer layers; a stage spanning types is
priced as its slowest device with even shares (SPMD across types with per-device ratios is
method "hetero", one stage). Both orders of the types are tried (fast first, slow first): which
end of the pipeline holds more in-flight activations changes which order fits and wins.
"""

from __future__ import annotations

from meshplan.cost.cluster import Cluster
from meshplan.cost.devices import DeviceType
from meshplan.cost.precision import DTYPES
from meshplan.planner.inter.stage_problem import DeviceKinds


def host_types(cluster: Cluster) -> tuple[DeviceType, ...] | None:
    """Each host's device type on a mixed cluster whose hosts are each of one type; None
    otherwise (one type, or a host of several: such a cluster plans as its slowest type)."""
    if not cluster.is_mixed or cluster.num_hosts < 2:
        return None
    per = cluster.devices_per_host
    hosts = [cluster.types[h * per:(h + 1) * per] for h in range(cluster.num_hosts)]
    if any(len(set(h)) != 1 for h in hosts):
        return None
    return tuple(h[0] for h in hosts)


def kind_types(types: tuple[DeviceType, ...], dtype: str) -> tuple[DeviceType, ...]:
    """The distinct device types of the hosts, fastest first: kind k is ``kind_types[k]``."""
    distinct = list(dict.fromkeys(types))
    return tuple(sorted(distinct, key=lambda t: -t.matmul_flops(DTYPES.get(dtype, dtype))))


def kind_layouts(types: tuple[DeviceType, ...], kinds: tuple[DeviceType, ...]
                 ) -> list[tuple[tuple[int, ...], DeviceKinds]]:
    """The DP's layouts of the hosts of ``types`` (one per host): ``(host ids in position
    order, their kinds)``, the fastest kind's hosts first and the slowest's first."""
    names = tuple(t.name for t in kinds)
    out = []
    for order in (kinds, kinds[::-1]):
        hosts = tuple(h for t in order for h, ht in enumerate(types) if ht == t)
        out.append((hosts, DeviceKinds(tuple(kinds.index(types[h]) for h in hosts), names)))
    return out


def stage_hosts(host_order: tuple[int, ...], sizes: list[int]) -> list[tuple[int, ...]]:
    """The hosts of consecutive stages of ``sizes`` hosts each, laid on ``host_order``."""
    out, at = [], 0
    for n in sizes:
        out.append(host_order[at:at + n])
        at += n
    return out
