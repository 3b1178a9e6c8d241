"""A lower bound of any plan's step time under the cost model: its arithmetic alone, spread
perfectly over every device.

Each op costs at least its FLOPs at the device's effective peak (`compute.op_time` takes the max
of that and its memory traffic), forward once and backward once (twice for a contraction), and a
plan can at best divide that work over all N devices: replication, recomputation, bubbles and
communication only add. So no plan of the program, by the cost model, is faster than

    Σ_op (1 + backward factor) · FLOPs / (N · peak(dtype) · matmul efficiency(dtype)).

A plan's distance from it says how much any other plan could still gain; issue 9's benchmark
prints it next to each plan.
"""

from __future__ import annotations

from meshplan.cost.cluster import Cluster
from meshplan.ir.graph import Graph

_LOW_PRECISION = ("float16", "bfloat16")


def compute_bound_s(graph: Graph, cluster: Cluster) -> float:
    """Seconds of one training step of ``graph`` (traced at the whole batch, at its compute
    dtype) that no plan on ``cluster`` can beat by the cost model (module docstring)."""
    device = cluster.device
    total = 0.0
    for n in graph.nodes:
        if n.is_source or not n.flops:
            continue
        dtype = n.out.dtype if n.out.dtype in _LOW_PRECISION else "float32"
        passes = 3.0 if n.sig is not None and n.sig.kind == "contraction" else 2.0
        total += passes * n.flops / device.matmul_flops(dtype)
    return total / cluster.num_devices
