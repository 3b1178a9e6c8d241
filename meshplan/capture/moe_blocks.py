"""Transformers' dropless sparse-MoE blocks, traced through `routed_experts`.

Mixtral's, Qwen-MoE's and OLMoE's blocks loop over the experts and find each one's tokens with
``nonzero``, which no plan can be made from (`routed_experts.py`). While capture traces, each
such block's ``forward`` is this module's: the same router (softmax, top-k, the blocks'
renormalization, the cast back), the experts as one `routed_experts` op, and Qwen2-MoE's shared
expert as its own modules run it. DeepSeek's layout (DeepSeek-V2/V3, dots.llm1, GLM-4.5) keeps
its router, its shared experts and the loop apart: the loop is a method ``moe(hidden_states,
topk_indices, topk_weights)``, and only that method is replaced (`EXPERT_LOOPS`); the router
(grouped top-k, sigmoid scores, bias correction) is traced as ordinary ops. On one device it
computes what transformers' loop computes. The model is left as it was (the instance
attributes are removed afterwards); nothing changes at run time, where the planned program
calls the op.

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

# Blocks whose expert loop is ``moe(hidden_states, topk_indices, topk_weights)``: the sum over
# each token's k experts of weight x expert, accumulated at the weights' dtype and returned at
# the tokens' (V2 sums slot by slot where the others add expert by expert: the same sum, in
# another order). Their experts' projections are all named as Llama's MLP names them.
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_LOOPS: dict[str, tuple[str, str, str]] = {
    name: _LLAMA_MLP for name in ("DeepseekV2MoE", "DeepseekV3MoE", "Dots1MoE", "Glm4MoeMoE",
                                  "Glm4vMoeTextMoE", "LongcatFlashMoE")}


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


def _weights(block: nn.Module, projections: tuple[str, str, str], where: str
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], str]:
    mats: tuple[list[torch.Tensor], ...] = ([], [], [])
    experts = getattr(block, "experts", None)
    odd = [e for e in experts if not all(hasattr(e, a) for a in (*projections, "act_fn"))] \
        if isinstance(experts, nn.ModuleList) else [experts]
    if odd:
        what = (f"{type(experts).__name__}" if not isinstance(experts, nn.ModuleList) else
                f"a ModuleList holding {len(odd)} {type(odd[0]).__name__}")
        raise ValueError(f"meshplan traces the experts of {where} as one op when they are a "
                         f"ModuleList of gated MLPs ({', '.join(projections)}, act_fn), "
                         f"as transformers 4.50-4.57 builds them; this block's are {what}")
    for expert in experts:
        for names, attr in zip(mats, projections):
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
    gate, up, down, act = _weights(block, kind.projections, where)
    out = routed_experts(x, chosen, routing, gate, up, down, act)
    if kind.shared:
        shared = block.shared_expert(x)
        out = out + F.sigmoid(block.shared_expert_gate(x)) * shared
    return out.reshape(batch, seq, width), router_logits


def _expert_loop(block: nn.Module, projections: tuple[str, str, str], where: str,
                 hidden_states: torch.Tensor, topk_indices: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    gate, up, down, act = _weights(block, projections, where)
    out = routed_experts(hidden_states, topk_indices, topk_weights, gate, up, down, act)
    return out.to(hidden_states.dtype)


@contextlib.contextmanager
def static_routing(model: nn.Module) -> Iterator[None]:
    """Within: every known sparse-MoE block of ``model`` runs `_forward` (`BLOCKS`) or its
    expert loop as `_expert_loop` (`EXPERT_LOOPS`); after, each runs its own code again,
    whatever happened."""
    patched = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        where = f"{name or 'the model'} ({kind})"
        if kind in BLOCKS and "forward" not in vars(module):
            module.forward = (lambda m, k, w: lambda h: _forward(m, k, w, h))(
                module, BLOCKS[kind], where)
            patched.append((module, "forward"))
        elif kind in EXPERT_LOOPS and "moe" not in vars(module):
            module.moe = (lambda m, p, w: lambda h, i, t: _expert_loop(m, p, w, h, i, t))(
                module, EXPERT_LOOPS[kind], where)
            patched.append((module, "moe"))
    try:
        yield
    finally:
        for module, attr in patched:
            delattr(module, attr)
