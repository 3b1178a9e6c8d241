"""Transformers' dropless sparse-MoE blocks, traced through `routed_experts`.

Mixtral's, Qwen-MoE's and OLMoE's blocks loop over the experts and find each one's tokens with
``nonzero``, which no plan can be made from (`routed_experts.py`). While capture traces, each
such block's ``forward`` is this module's: the same router (softmax, top-k, the blocks'
renormalization, the cast back), the experts as one `routed_experts` op, and Qwen2-MoE's shared
expert as its own modules run it. On one device it computes what transformers' loop computes.
The model is left as it was (the instance attribute is removed afterwards); nothing changes at
run time, where the planned program calls the op.

Blocks are known by class name, so a block of another version that keeps the name and the
attributes works too; one whose experts are not gated MLPs of bias-free ``nn.Linear`` (or that
draws router noise) is refused with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.capture.routed_experts import routed_experts


@dataclass(frozen=True)
class SparseBlock:
    """How a sparse-MoE block class names its parts: its experts' three projections (gate, up,
    down), whether it always renormalizes the top-k weights (else its ``norm_topk_prob``
    says), and whether it adds a gated shared expert (``shared_expert``,
    ``shared_expert_gate``)."""

    projections: tuple[str, str, str]
    always_renormalize: bool
    shared: bool = False


BLOCKS: dict[str, SparseBlock] = {
    "MixtralSparseMoeBlock": SparseBlock(("w1", "w3", "w2"), always_renormalize=True),
    "Qwen2MoeSparseMoeBlock": SparseBlock(("gate_proj", "up_proj", "down_proj"),
                                          always_renormalize=False, shared=True),
    "Qwen3MoeSparseMoeBlock": SparseBlock(("gate_proj", "up_proj", "down_proj"),
                                          always_renormalize=False),
    "OlmoeSparseMoeBlock": SparseBlock(("gate_proj", "up_proj", "down_proj"),
                                       always_renormalize=False),
}


def _activation_name(fn: nn.Module, where: str) -> str:
    """The `routed_experts` name of an expert's activation module (transformers' ACT2FN)."""
    kind = type(fn).__name__
    if isinstance(fn, nn.SiLU) or kind == "SiLUActivation":
        return "silu"
    if isinstance(fn, nn.ReLU):
        return "relu"
    if kind == "GELUActivation" or (isinstance(fn, nn.GELU) and fn.approximate == "none"):
        return "gelu"
    if kind in ("PytorchGELUTanh", "NewGELUActivation", "GELUTanh") or (
            isinstance(fn, nn.GELU) and fn.approximate == "tanh"):
        return "gelu_tanh"
    raise ValueError(f"meshplan traces the experts of {where} as one op, which knows the "
                     f"activations silu, gelu, gelu_tanh and relu, not {kind}")


def _weights(block: nn.Module, kind: SparseBlock, where: str
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], str]:
    mats: tuple[list[torch.Tensor], ...] = ([], [], [])
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.ModuleList) or not all(
            hasattr(e, a) for e in experts for a in (*kind.projections, "act_fn")):
        raise ValueError(f"meshplan traces the experts of {where} as one op when they are a "
                         f"ModuleList of gated MLPs ({', '.join(kind.projections)}, act_fn), "
                         "as transformers 4.50-4.57 builds them; this block's are "
                         f"{type(experts).__name__}")
    for expert in experts:
        for names, attr in zip(mats, kind.projections):
            linear = getattr(expert, attr)
            if not isinstance(linear, nn.Linear) or linear.bias is not None:
                raise ValueError(f"meshplan traces the experts of {where} as one op of "
                                 f"bias-free linear layers; its expert's {attr} is {linear}")
            names.append(linear.weight)
    return (*mats, _activation_name(experts[0].act_fn, where))


def _forward(block: nn.Module, kind: SparseBlock, where: str, hidden_states: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    if block.training and getattr(block, "jitter_noise", 0.0) > 0:
        raise ValueError(f"{where} multiplies its input by router noise (router_jitter_noise="
                         f"{block.jitter_noise}), a random draw meshplan cannot reproduce on "
                         "split tensors; set router_jitter_noise=0 in the model's config")
    batch, seq, width = hidden_states.shape
    x = hidden_states.view(-1, width)
    router_logits = block.gate(x)
    routing = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing, chosen = torch.topk(routing, block.top_k, dim=-1)
    if kind.always_renormalize or block.norm_topk_prob:
        routing /= routing.sum(dim=-1, keepdim=True)
    routing = routing.to(x.dtype)
    gate, up, down, act = _weights(block, kind, where)
    out = routed_experts(x, chosen, routing, gate, up, down, act)
    if kind.shared:
        shared = block.shared_expert(x)
        out = out + F.sigmoid(block.shared_expert_gate(x)) * shared
    return out.reshape(batch, seq, width), router_logits


@contextlib.contextmanager
def static_routing(model: nn.Module) -> Iterator[None]:
    """Within: every known sparse-MoE block of ``model`` (`BLOCKS`) runs `_forward`; after,
    each runs its own forward again, whatever happened."""
    patched = []
    for name, module in model.named_modules():
        kind = BLOCKS.get(type(module).__name__)
        if kind is None or "forward" in vars(module):
            continue
        where = f"{name or 'the model'} ({type(module).__name__})"
        module.forward = (lambda m, k, w: lambda h: _forward(m, k, w, h))(module, kind, where)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
