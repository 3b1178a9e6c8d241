"""cost pass: cluster and device descriptions, the logical mesh, and the α-β / roofline / memory models."""

from meshplan.cost.cluster import Cluster, load_cluster_yaml, parse_cluster_spec, preset_cluster
from meshplan.cost.collectives import (
    collective_cost,
    grouped_broadcast_cost,
    padded_all_gather_cost,
    send_recv_cost,
)
from meshplan.cost.compute import op_time, train_op_time
from meshplan.cost.devices import DeviceType, Link, device_type, link_preset
from meshplan.cost.memory import (OptimizerState, ParamMemory, optimizer_state_bytes_per_param,
                                  param_memory_per_device)
from meshplan.cost.mesh import LogicalMesh, logical_mesh, parse_mesh_shape

__all__ = [
    "Cluster",
    "DeviceType",
    "Link",
    "LogicalMesh",
    "OptimizerState",
    "ParamMemory",
    "collective_cost",
    "device_type",
    "grouped_broadcast_cost",
    "link_preset",
    "load_cluster_yaml",
    "logical_mesh",
    "op_time",
    "optimizer_state_bytes_per_param",
    "padded_all_gather_cost",
    "param_memory_per_device",
    "parse_cluster_spec",
    "parse_mesh_shape",
    "preset_cluster",
    "send_recv_cost",
    "train_op_time",
]
