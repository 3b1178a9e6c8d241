"""Optimizers over local shards.

SGD, Adam and AdamW are elementwise, so stepping each rank's shard of a parameter with torch's
own optimizer gives exactly the shard of the single-device update. Adafactor is not (its second
moments are per row and column, its step scales with the parameter's RMS): on shards it runs as
`meshplan.runtime.adafactor.ShardedAdafactor`. An `OptimizerSpec` is the plain description a plan
carries; `make_optimizer` builds the torch optimizer of one device's whole parameters.
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

import torch

from meshplan.cost.memory import OPTIMIZERS, OptimizerState

_DEFAULT_LR = {"adafactor": 1e-2}  # torch's defaults where they differ from 1e-3


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyper-parameters (torch's defaults where not given)."""

    kind: str = "adamw"
    lr: float = 1e-3
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    nesterov: bool = False   # SGD's (elementwise like momentum itself)
    # Adafactor's (torch.optim.Adafactor's names and defaults; eps1 None: the dtype's epsilon)
    beta2_decay: float = -0.8
    eps1: float | None = None
    eps2: float = 1e-3
    d: float = 1.0
    # Before each update, scale every gradient so their global L2 norm is at most this (as
    # torch.nn.utils.clip_grad_norm_ over all parameters); None: no clipping.
    max_grad_norm: float | None = None
    # The parameter groups after the first, as the torch optimizer had them: per group, its
    # parameters' names and the hyper-parameters (`GROUP_KEYS`) it sets apart from the first
    # (weight decay off for biases and norms, a layer's own learning rate).
    groups: tuple[tuple[tuple[str, ...], tuple[tuple[str, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.kind!r}")
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and 0 < self.max_grad_norm < math.inf):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got "
                             f"{self.max_grad_norm!r}")

    def state_bytes_per_param(self, param_bytes: int = 4) -> float:
        """Optimizer state per parameter element kept elementwise: Adam keeps two moments, SGD a
        momentum, Adafactor none (`state`)."""
        if self.kind in ("adam", "adamw"):
            return 2.0 * param_bytes
        if self.kind == "sgd" and self.momentum:
            return float(param_bytes)
        return 0.0

    def state(self) -> OptimizerState:
        """The optimizer state the cost model charges per parameter (by shape)."""
        return OptimizerState(self.state_bytes_per_param(), factored=self.kind == "adafactor")

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples), so a plan equals its own JSON round trip."""
        return {**asdict(self), "betas": list(self.betas),
                "groups": [[list(names), [list(kv) for kv in keys]]
                           for names, keys in self.groups]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "OptimizerSpec":
        groups = tuple((tuple(names), tuple((k, float(v)) for k, v in keys))
                       for names, keys in d.get("groups", ()))
        return OptimizerSpec(**{**d, "betas": tuple(d.get("betas", (0.9, 0.999))),
                                "groups": groups})

    def param_groups(self, names: Sequence[str]) -> list[tuple[list[int], dict[str, float]]]:
        """The torch parameter groups of the parameters ``names`` (positions into it): the
        first group's hyper-parameters, then each later group's own."""
        group = {n: i + 1 for i, (members, _) in enumerate(self.groups) for n in members}
        return [([j for j, n in enumerate(names) if group.get(n, 0) == i], dict(keys))
                for i, keys in enumerate([(), *(keys for _, keys in self.groups)])]


def optimizer_spec(opt: Any, names: Mapping[int, str] | None = None) -> OptimizerSpec:
    """Describe a torch optimizer instance, a name (``"adamw"``), or pass a spec through;
    ``names``: the model's parameter names by ``id`` (an optimizer of several groups).

    Raises ValueError for an optimizer meshplan cannot step shard-wise.
    """
    if isinstance(opt, OptimizerSpec):
        return opt
    if isinstance(opt, str):
        kind = opt.lower()
        return OptimizerSpec(kind=kind, lr=_DEFAULT_LR.get(kind, 1e-3))
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw",
             torch.optim.Adafactor: "adafactor"}
    kind = kinds.get(type(opt))
    if kind is None:
        raise ValueError(f"unsupported optimizer {type(opt).__name__}; meshplan steps "
                         "torch.optim.SGD, Adam, AdamW and Adafactor on local shards")
    first = _group_spec(type(opt).__name__, kind, opt.param_groups[0])
    later = opt.param_groups[1:]
    if not later:
        return first
    if kind == "adafactor":
        raise ValueError("Adafactor with several parameter groups is not supported: its "
                         "sharded update takes one set of hyper-parameters")
    if names is None:
        raise ValueError("an optimizer with several parameter groups is described with its "
                         "model's parameter names: plan it with meshplan.plan(model, ...)")
    groups = []
    for i, g in enumerate(later, 1):
        spec = _group_spec(type(opt).__name__, kind, g)
        apart = [k for k in asdict(spec) if getattr(spec, k) != getattr(first, k)]
        if set(apart) - set(GROUP_KEYS):
            raise ValueError(f"parameter group {i} sets {sorted(set(apart) - set(GROUP_KEYS))} "
                             f"apart from group 0; meshplan's groups may differ only in "
                             f"{', '.join(GROUP_KEYS)}")
        strays = [p for p in g["params"] if id(p) not in names]
        if strays:
            raise ValueError(f"parameter group {i} holds tensors that are not parameters of "
                             "this model; give the optimizer of this model")
        groups.append((tuple(names[id(p)] for p in g["params"]),
                       tuple((k, float(getattr(spec, k))) for k in apart)))
    return replace(first, groups=tuple(groups))


# What a later parameter group may set apart from the first (the plan prices every group's
# state alike: it depends on the optimizer's kind only).
GROUP_KEYS = ("lr", "weight_decay")


def _group_spec(name: str, kind: str, g: dict[str, Any]) -> OptimizerSpec:
    """The spec of one parameter group ``g`` of a torch optimizer ``name`` of ``kind``."""
    # Options the spec does not carry would be dropped silently by the ranks' optimizers.
    unsupported = {"maximize": False, "amsgrad": False, "dampening": 0.0,
                   "capturable": False, "differentiable": False, "decoupled_weight_decay": False}
    for key, default in unsupported.items():
        if key in g and g[key] not in (default, None) and not (
                key == "decoupled_weight_decay" and kind == "adamw"):
            raise ValueError(f"{name}({key}={g[key]!r}) is not supported by "
                             f"meshplan's sharded update; use {key}={default!r}")
    if kind == "adafactor":
        eps1, eps2 = g["eps"]
        return OptimizerSpec(kind, float(g["lr"]), weight_decay=float(g["weight_decay"]),
                             beta2_decay=float(g["beta2_decay"]),
                             eps1=None if eps1 is None else float(eps1), eps2=float(eps2),
                             d=float(g["d"]))
    return OptimizerSpec(kind, float(g["lr"]), float(g.get("momentum", 0.0)),
                         tuple(g.get("betas", (0.9, 0.999))), float(g.get("eps", 1e-8)),
                         float(g.get("weight_decay", 0.0)), bool(g.get("nesterov", False)))


def make_optimizer(spec: OptimizerSpec, tensors: Iterable[torch.Tensor],
                   names: Sequence[str] | None = None) -> torch.optim.Optimizer:
    """The torch optimizer of ``spec`` over the given leaf tensors (of the parameters
    ``names``, in the spec's groups): on a GPU torch's fused kernels (one pass over each
    parameter's value, gradient and state, which is what the cost model prices:
    `OptimizerState.update_bytes_per_element`) where torch's default, the ``foreach`` kernels,
    takes about three passes; elsewhere torch's default."""
    tensors = list(tensors)
    # A pipeline stage may hold no parameters (a loss's last ops, a pooling head): torch
    # refuses an empty list but steps a group without tensors, as a no-op.
    params: Any = tensors or [{"params": []}]
    if spec.groups and names is not None:
        params = [{"params": [tensors[j] for j in members], **keys}
                  for members, keys in spec.param_groups(list(names))]
    fused = {"fused": True} if tensors and all(t.is_cuda and t.is_floating_point()
                                               for t in tensors) else {}
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, nesterov=spec.nesterov, **fused)
    if spec.kind == "adafactor":
        return torch.optim.Adafactor(params, lr=spec.lr, beta2_decay=spec.beta2_decay,
                                     eps=(spec.eps1, spec.eps2), d=spec.d,
                                     weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.kind == "adam" else torch.optim.AdamW
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
               weight_decay=spec.weight_decay, **fused)
