"""meshplan's graph IR: the forward + loss program as plain, hashable data.

A `Graph` is a topologically ordered tuple of `Node`s. Each node produces one tensor: a
multi-output aten op is represented by its first output when that is all the forward reads, else
each output the forward reads is a node of its own (named after its fx ``getitem``). Constants
(``arange``, ``new_ones``, tensor constants traced as fx ``get_attr``) are source nodes with role
``"constant"``, replicated.
Its `sig` says how the op's dimensions relate (see `signatures.py`); the planner derives every
sharding strategy from it. Nodes keep the name of the fx node they came from, so a plan can be
bound back to the traced program.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property

from meshplan.ir.signatures import Signature

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "bool": 1, "uint8": 1, "int8": 1, "complex64": 8, "complex128": 16,
               "complex32": 4}

# Roles of nodes that have no inputs.
SOURCE_ROLES = ("param", "buffer", "input", "target", "constant")


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor (dtype by name, e.g. ``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str

    # Remembered: the formulations read them per strategy pair, hundreds of thousands of
    # times a stage search.
    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


# Ops whose output shares its operand's storage: what a saved view keeps alive is its base.
# The op of a node that writes a new value into a buffer (`capture/to_ir.py`): the forward's
# update of its running statistics, counters or moving averages. Its operands are the buffer
# and the value, both replicated; nothing reads its result.
BUFFER_WRITE = "buffer_write"

ALIASING_OPS = frozenset({"view", "t", "transpose", "permute", "expand", "slice", "split",
                          "unbind", "select", "alias", "detach", "as_strided", "diagonal"})


@dataclass(frozen=True)
class Node:
    """One op of the forward + loss program.

    ``role`` is one of SOURCE_ROLES for sources, else ``"op"``. ``op`` is the normalized op name
    (``"mm"``, ``"add"``, ``"sdpa"``…; the role for sources). ``inputs`` are the names of the
    tensor operands in argument order. ``flops`` counts forward FLOPs; ``nbytes`` the bytes the
    op reads and writes. ``requires_grad`` is true when the value depends on a parameter.
    ``state_name`` is the state-dict name of a parameter or buffer. ``kept``: whether the
    value's storage stays alive for backward (autograd saves it, or a view of it); None when
    capture could not tell, and the memory model assumes every differentiable value is kept.
    ``batch_dims``: of an ``"input"`` source, the dims that carry the batch when it is not just
    dim 0 (a value a pipeline stage receives, as the whole program batches it); None: dim 0.
    ``half_bias``: the bias add of a linear layer or convolution the capture split off, which
    mixed precision runs at the half type as autocast's fused op does (`capture/trace.py`).
    """

    name: str
    role: str
    op: str
    inputs: tuple[str, ...]
    out: TensorInfo
    sig: Signature | None
    flops: float = 0.0
    nbytes: float = 0.0
    requires_grad: bool = False
    state_name: str | None = None
    kept: bool | None = None
    batch_dims: tuple[int, ...] | None = None
    half_bias: bool = False

    @property
    def is_source(self) -> bool:
        return self.role in SOURCE_ROLES


@dataclass(frozen=True)
class Graph:
    """A topologically ordered program; ``loss`` names the node producing the scalar loss."""

    nodes: tuple[Node, ...]
    loss: str
    unsupported_ops: tuple[str, ...] = field(default=())

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    def fingerprint(self) -> str:
        """A short hash of ops, shapes and dtypes: equal for equal programs."""
        text = "\n".join(f"{n.name}|{n.role}|{n.op}|{n.inputs}|{n.out.shape}|{n.out.dtype}"
                         for n in self.nodes)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def params(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.role == "param")

    def num_params(self) -> int:
        return sum(n.out.numel for n in self.params())
