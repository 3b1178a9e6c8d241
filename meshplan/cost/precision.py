"""Mixed precision as the cost model sees it: the program with its activations at the compute
dtype.

Under autocast (and in Megatron's or DeepSpeed's fp16/bf16 training) matmuls and convolutions run
at the half type and the activations between them are kept and communicated at its size, while
parameters stay fp32 masters (their memory, gradients and optimizer state are counted by
`meshplan.cost.memory`, 16 B per parameter with Adam either way). So the cost graph is the traced
graph with every float op output recast: compute is priced at the dtype's peak
(`OpCosts.compute_cost` reads the output dtype), collectives and kept activations at its size.
Parameters, buffers and batch tensors keep their traced dtype.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.cost.devices import DeviceType
from meshplan.ir.graph import DTYPE_BYTES, Graph, Node, TensorInfo

# The names users write and the torch dtype names the IR uses.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_FLOATS = ("float32", "float16", "bfloat16")


def check_dtype(name: str) -> str:
    """``name`` if it is a training dtype ("fp32", "bf16", "fp16", or "auto"); else ValueError."""
    if name not in (*DTYPES, "auto"):
        raise ValueError(f"unknown dtype {name!r}; valid: {[*DTYPES, 'auto']}")
    return name


def default_dtype(device: DeviceType | None) -> str:
    """What a user trains at on ``device``: bf16 where it runs faster than fp32, else fp16 where
    that does (V100, T4, P100), else fp32 (a CPU, or abstract units with no device)."""
    if device is None:
        return "fp32"
    peaks = dict(device.peak_flops)
    fp32 = peaks.get("float32", 0.0)
    for name in ("bf16", "fp16"):
        if peaks.get(DTYPES[name], 0.0) > fp32:
            return name
    return "fp32"


def resolve_dtype(name: str, device: DeviceType | None) -> str:
    """``name``, or the device's default for "auto"; ValueError for an unknown name or a dtype
    the device has no peak for."""
    name = default_dtype(device) if check_dtype(name) == "auto" else name
    if device is not None and DTYPES[name] not in dict(device.peak_flops):
        raise ValueError(f"device {device.name!r} has no {name} peak; valid dtypes for it: "
                         f"{[k for k, v in DTYPES.items() if v in dict(device.peak_flops)]}")
    return name


def with_compute_dtype(graph: Graph, dtype: str) -> Graph:
    """``graph`` with every float op output at ``dtype`` (module docstring); "fp32" returns it
    unchanged."""
    target = DTYPES[check_dtype(dtype)]
    if target == "float32":
        return graph
    nodes = tuple(_recast(n, target) for n in graph.nodes)
    return Graph(nodes, graph.loss, graph.unsupported_ops)


def _recast(node: Node, target: str) -> Node:
    if node.role != "op" or node.out.dtype not in _FLOATS or node.out.dtype == target:
        return node
    ratio = DTYPE_BYTES[target] / DTYPE_BYTES[node.out.dtype]
    return replace(node, out=TensorInfo(node.out.shape, target), nbytes=node.nbytes * ratio)
