"""Mixed precision as the cost model sees it: the program with each activation at the dtype
the runtime computes it in.

The runtime runs each micro-batch's program under ``torch.autocast`` with fp32 master
parameters (their memory, gradients and optimizer state are counted by `meshplan.cost.memory`,
16 B per parameter with Adam either way). Autocast runs the ops of its lower-precision list at
the half type — here the contractions `HALF_OPS` — and every other op at the promoted type of
its inputs, as eager PyTorch does. So the cost graph is the traced graph with dtypes propagated
that way: a matmul's output is half, a bias or residual add with an fp32 operand (a parameter,
the fp32 embedding) is fp32; normalizations and the NLL keep their data operand's dtype (as
torch's mixed-dtype kernels do under fp32 weights), and so do the statistics they exchange
across a split batch or class dim (batch norm's are float64 sums whatever it is). Compute is
priced at the output's dtype peak (`OpCosts.compute_cost` reads it), collectives, transfers and
kept activations at its size; a gradient has its value's dtype (autocast's casts are differentiable,
so the gradient of an fp32 value is fp32). Parameters, buffers and batch tensors keep their
traced dtype.

The capture splits ``addmm`` and a biased convolution into the contraction and an ``add``
(partial sums must be reduced before the bias); that add (`Node.half_bias`) runs at the half
type as eager autocast's fused op does, both operands cast (`lower/program.py`), so a biased
linear layer's output is half, as in eager; an add the model itself writes after a matmul
promotes as eager's does.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.cost.devices import DeviceType
from meshplan.ir.graph import DTYPE_BYTES, Graph, Node, TensorInfo

# The names users write and the torch dtype names the IR uses.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_FLOATS = ("float32", "float16", "bfloat16")
# The half types mixed precision computes in.
HALF_TYPES = frozenset({"float16", "bfloat16"})


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


# The ops autocast computes at the half type (in its lower-precision list on every device), and
# meshplan's routed experts, which compute at autocast's type as linear does.
HALF_OPS = frozenset({"mm", "bmm", "matmul", "conv", "sdpa", "routed_experts"})


def runs_half(node: Node) -> bool:
    """Whether mixed precision runs ``node`` at the half type whatever its operands' dtypes:
    a contraction of `HALF_OPS`, or the bias add the capture split from one (`Node.half_bias`),
    whose operands the runtime casts (`lower/program.py`)."""
    return node.op in HALF_OPS or node.half_bias


# Ops whose output keeps their data operand's dtype under fp32 parameters (torch's mixed-dtype
# normalization kernels) rather than promoting.
FOLLOW_DATA_OPS = frozenset({"layer_norm", "batch_norm", "nll_loss"})


def with_compute_dtype(graph: Graph, dtype: str) -> Graph:
    """``graph`` with its float op outputs at the dtypes autocast at ``dtype`` computes them in
    (module docstring); "fp32" returns it unchanged."""
    target = DTYPES[check_dtype(dtype)]
    if target == "float32":
        return graph
    traced = {n.name: n.out.dtype for n in graph.nodes}
    dtypes: dict[str, str] = {}
    nodes = []
    for n in graph.nodes:
        new = _autocast_dtype(n, target, dtypes)
        dtypes[n.name] = new
        n = _resize_stats(n, traced, dtypes)
        nodes.append(n if new == n.out.dtype else _recast(n, new))
    return Graph(tuple(nodes), graph.loss, graph.unsupported_ops)


def _autocast_dtype(node: Node, target: str, dtypes: dict[str, str]) -> str:
    """The dtype of ``node``'s output under autocast at ``target``, given its inputs'."""
    if node.role != "op" or node.out.dtype not in _FLOATS:
        return node.out.dtype
    if runs_half(node):
        return target
    if node.op in FOLLOW_DATA_OPS and dtypes[node.inputs[0]] in _FLOATS:
        return dtypes[node.inputs[0]]
    floats = {dtypes[i] for i in node.inputs if dtypes[i] in _FLOATS}
    if not floats:   # a float made from integers (a mask, an iota): as traced
        return node.out.dtype
    return max(floats, key=lambda d: DTYPE_BYTES[d])


def _recast(node: Node, dtype: str) -> Node:
    ratio = DTYPE_BYTES[dtype] / DTYPE_BYTES[node.out.dtype]
    return replace(node, out=TensorInfo(node.out.shape, dtype), nbytes=node.nbytes * ratio)


def _resize_stats(node: Node, traced: dict[str, str], dtypes: dict[str, str]) -> Node:
    """``node`` with the statistics it exchanges (`StatSync`) at its data operand's new dtype."""
    sync = node.sig.sync if node.sig is not None else None
    if sync is None or not sync.follows_input or not node.inputs:
        return node
    was, now = traced[node.inputs[0]], dtypes[node.inputs[0]]
    if was == now or was not in _FLOATS or now not in _FLOATS:
        return node
    nbytes = sync.nbytes * DTYPE_BYTES[now] // DTYPE_BYTES[was]
    return replace(node, sig=replace(node.sig, sync=replace(sync, nbytes=nbytes)))
