"""Shared by the heterogeneous-cluster tests: a 4-device cluster of four speeds on a fast
link of little latency (compute dominates, and moving activations can beat moving weights, so
synthesis splits work unevenly, MoE experts and MLP layers with uneven gathers), the models of
the issue's acceptance, and a worker that reports which gather implementations ran."""

from __future__ import annotations

from collections import Counter
from typing import Any

import meshplan
from meshplan.cost.cluster import Cluster, mixed_cluster
from meshplan.cost.devices import DeviceType, Link
from meshplan.runtime.comm import Comm, ProcessGroupComm
from meshplan.zoo.spec import build_workload
from oracle import cpu_capture, plan_counter as planned, train_rank  # noqa: F401 (shared)

MODELS = {
    "mlp": "mlp:layers=3,hidden=16,batch=8,bias=1",
    "bert": "bert:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=8",
    "moe": "moe:hidden=16,layers=2,heads=2,experts=4,seq=8,vocab=32,batch=4",
}
RATIOS = ((1.0,), (0.4, 0.3, 0.2, 0.1))


def _device(name: str, flops: float) -> DeviceType:
    return DeviceType(name, {"float32": flops}, 16 * 2**30, flops, 1.0, 1.0)


def four_speeds() -> Cluster:
    """Two hosts of two devices, 4:3:2:1 in speed, on 1 GB/s links of 0.1 µs latency."""
    link = Link(1e9, 1e-7)
    return mixed_cluster("four-speeds", [[_device("fast", 4e9), _device("mid", 3e9)],
                                         [_device("slow", 2e9), _device("slowest", 1e9)]],
                         link, link)


def impls(comm: Comm) -> Counter:
    return Counter((r.kind, r.impl) for r in comm.records)


def train_gloo(rank: int, nprocs: int, plan: Any, spec: str, data: list) -> tuple:
    """Train on a real gloo rank; the oracle's result and the implementations recorded."""
    comm = ProcessGroupComm(plan.mesh_shape)
    result = train_rank(comm, plan, build_workload(spec, device="cpu", seed=0), data,
                        cpu_capture(spec, plan.microbatches))
    return result, impls(comm)


def without_bytes(counter: Counter) -> Counter:
    out: Counter = Counter()
    for (kind, _, axes, phase), n in counter.items():
        out[(kind, axes, phase)] += n
    return out
