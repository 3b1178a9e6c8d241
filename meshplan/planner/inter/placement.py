"""Place pipeline stages' submeshes on the physical cluster (Alpa §5.2: shapes (1, 2^k) and
(k, M) always tile an N x M cluster when their devices add up to N * M).

In stage order on contiguous devices when every submesh fits there (a single-host one inside
a host, a multi-host one from a host's first device): neighbouring stages then share a host
wherever they can, so their transfers run over the devices' own links, and this is the layout
the stage DP prices its boundaries by (`stage_problem.Links`). Otherwise multi-host submeshes
take whole hosts, in stage order, from host 0 up, and single-host submeshes are packed into
the remaining hosts, largest first, each into the first host with room (sizes that are powers
of two dividing M pack exactly, as Alpa proves). Devices are global ids, host-major: device d
of host h is ``h * M + d``.
"""

from __future__ import annotations

from typing import Sequence

from meshplan.planner.inter.stage_problem import placeable

Submesh = tuple[int, int]


def place_submeshes(submeshes: Sequence[Submesh], num_hosts: int, devices_per_host: int
                    ) -> list[tuple[int, ...]]:
    """The global device ids of each submesh, in the given order. Raises ValueError when the
    submeshes do not tile the cluster."""
    total = sum(h * d for h, d in submeshes)
    if total != num_hosts * devices_per_host:
        raise ValueError(f"submeshes {list(submeshes)} hold {total} devices, the cluster "
                         f"{num_hosts * devices_per_host}")
    in_order, offset = [], 0
    for h, d in submeshes:
        if h > 1 and d != devices_per_host:
            raise ValueError(f"a multi-host submesh uses whole hosts; got {(h, d)}")
        if not placeable((h, d), offset, devices_per_host):
            break
        in_order.append(tuple(range(offset, offset + h * d)))
        offset += h * d
    else:
        return in_order
    out: list[tuple[int, ...] | None] = [None] * len(submeshes)
    host = 0
    for i, (h, d) in enumerate(submeshes):
        if h > 1:
            if d != devices_per_host:
                raise ValueError(f"a multi-host submesh uses whole hosts; got {(h, d)}")
            out[i] = tuple(range(host * d, (host + h) * d))
            host += h
    free = {k: devices_per_host for k in range(host, num_hosts)}
    singles = sorted((i for i, (h, _) in enumerate(submeshes) if h == 1),
                     key=lambda i: -submeshes[i][1])
    for i in singles:
        d = submeshes[i][1]
        k = next((k for k in sorted(free) if free[k] >= d), None)
        if k is None:
            raise ValueError(f"submeshes {list(submeshes)} do not pack into {num_hosts} hosts "
                             f"of {devices_per_host} devices")
        start = k * devices_per_host + devices_per_host - free[k]
        out[i] = tuple(range(start, start + d))
        free[k] -= d
    return [o for o in out if o is not None]


def share_a_host(devices: Sequence[int], others: Sequence[int], devices_per_host: int) -> bool:
    """Whether two stages' global device ids all lie in one host (their boundary then runs
    over the devices' own links, `stage_costs.inbound_s`)."""
    return len({d // devices_per_host for d in (*devices, *others)}) == 1
