"""Optimizers over local shards.

SGD, Adam and AdamW are elementwise, so stepping each rank's shard of a parameter with torch's
own optimizer gives exactly the shard of the single-device update. An `OptimizerSpec` is the plain
description a plan carries; `make_optimizer` builds the torch optimizer on a rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyper-parameters (torch's defaults where not given)."""

    kind: str = "adamw"
    lr: float = 1e-3
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.kind!r}")

    def state_bytes_per_param(self, param_bytes: int = 4) -> float:
        """Optimizer state per parameter element: Adam keeps two moments, SGD a momentum."""
        if self.kind in ("adam", "adamw"):
            return 2.0 * param_bytes
        return float(param_bytes) if self.momentum else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples), so a plan equals its own JSON round trip."""
        return {**asdict(self), "betas": list(self.betas)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "OptimizerSpec":
        return OptimizerSpec(**{**d, "betas": tuple(d.get("betas", (0.9, 0.999)))})


def optimizer_spec(opt: Any) -> OptimizerSpec:
    """Describe a torch optimizer instance, a name (``"adamw"``), or pass a spec through.

    Raises ValueError for an optimizer meshplan cannot step shard-wise.
    """
    if isinstance(opt, OptimizerSpec):
        return opt
    if isinstance(opt, str):
        return OptimizerSpec(kind=opt.lower())
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
    kind = kinds.get(type(opt))
    if kind is None:
        raise ValueError(f"unsupported optimizer {type(opt).__name__}; meshplan steps "
                         "torch.optim.SGD, Adam and AdamW on local shards")
    g = opt.param_groups[0]
    if len(opt.param_groups) > 1:
        raise ValueError("optimizers with several parameter groups are not supported yet")
    return OptimizerSpec(kind, float(g["lr"]), float(g.get("momentum", 0.0)),
                         tuple(g.get("betas", (0.9, 0.999))), float(g.get("eps", 1e-8)),
                         float(g.get("weight_decay", 0.0)))


def make_optimizer(spec: OptimizerSpec, tensors: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer of ``spec`` over the given leaf tensors."""
    tensors = list(tensors)
    if spec.kind == "sgd":
        return torch.optim.SGD(tensors, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.kind == "adam" else torch.optim.AdamW
    return cls(tensors, lr=spec.lr, betas=spec.betas, eps=spec.eps,
               weight_decay=spec.weight_decay)
