"""Dropless top-k experts as one op of static shape: ``meshplan::routed_experts``.

A dropless mixture of experts (Mixtral, Qwen-MoE) runs each expert on the tokens routed to it,
found with ``nonzero``: how many each expert gets depends on the values, so no plan can be made
from the ops one by one. Taken whole, the layer has static shapes: tokens ``(T, H)`` and their
``k`` chosen experts and weights ``(T, k)`` in, ``(T, H)`` out. Each token's output depends only
on its own row, so the op splits over tokens (data parallelism); each expert is a gated MLP,
``down(act(gate(x)) * up(x))``, elementwise in its hidden units, so the op also splits over
those (Megatron's tensor parallelism of the experts, partial sums out). Its FLOPs are those of
``k`` expert MLPs per token, whatever the routing. The experts' weights are never split by
expert: a rank holding some experts would need the tokens routed to them, a count known only
from the data.

`moe_blocks.py` traces transformers' sparse-MoE blocks through this op; on one device it
computes what their loop computes, operation by operation. Its backward recomputes the two
input projections of each expert instead of keeping them (they are ``2 k F`` values per token,
``F`` the experts' hidden size), so autograd keeps only the op's inputs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from meshplan.capture.rule_base import OpCall, OpRule, sized

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "relu": F.relu,
}


def _activation(act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if act not in ACTIVATIONS:
        raise ValueError(f"routed_experts: unknown activation {act!r}; known: "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _rows(experts: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, slots) routed to expert ``e``, slot-major as transformers' loop takes them."""
    slot, token = torch.where(experts.t() == e)
    return token, slot


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the op computes and returns in: autocast's half type where autocast is on (the
    op is a contraction, as ``linear`` is: `cost/precision.HALF_OPS`), else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@torch.library.custom_op("meshplan::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor],
                   act: str) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = experts[t, j]``: ``x`` (T, H); ``experts`` (T, k) int; ``weights`` (T, k) in x's dtype;
    per expert ``gate[e]``, ``up[e]`` (F, H) and ``down[e]`` (H, F) as ``nn.Linear`` holds
    them. Computed and returned in `compute_dtype`."""
    fn, dt = _activation(act), compute_dtype(x)
    out = torch.zeros(x.shape, dtype=dt, device=x.device)
    for e in range(len(gate)):
        token, slot = _rows(experts, e)
        if token.numel() == 0:
            continue
        rows = x[token].to(dt)
        hidden = fn(F.linear(rows, gate[e].to(dt))) * F.linear(rows, up[e].to(dt))
        y = F.linear(hidden, down[e].to(dt)) * weights[token, slot, None]
        out.index_add_(0, token, y.to(dt))
    return out


@routed_experts.register_fake
def _(x, experts, weights, gate, up, down, act):
    return torch.empty(x.shape, dtype=compute_dtype(x), device=x.device)


def _setup(ctx, inputs, output) -> None:
    x, experts, weights, gate, up, down, act = inputs
    ctx.act, ctx.num, ctx.dtype = act, len(gate), output.dtype
    ctx.save_for_backward(x, experts, weights, *gate, *up, *down)


def _backward(ctx, grad: torch.Tensor):
    x, experts, weights, *mats = ctx.saved_tensors
    n, dt = ctx.num, ctx.dtype
    fn = _activation(ctx.act)
    gx, gw = torch.zeros_like(x), torch.zeros_like(weights)
    grads = [torch.zeros_like(m) for m in mats]
    g_gate, g_up, g_down = grads[:n], grads[n:2 * n], grads[2 * n:]
    for e in range(n):
        token, slot = _rows(experts, e)
        if token.numel() == 0:
            continue
        gate, up, down = (mats[e].to(dt), mats[n + e].to(dt), mats[2 * n + e].to(dt))
        rows, g_rows = x[token].to(dt), grad[token].to(dt)
        w = weights[token, slot, None].to(dt)
        a, b = F.linear(rows, gate), F.linear(rows, up)
        with torch.enable_grad():
            a_in = a.detach().requires_grad_()
            s = fn(a_in)
        hidden = s.detach() * b
        # d/dy of the weighted output, through down: the routing weight's gradient is its
        # inner product with the hidden units (= <grad, y>), theirs that times the weight.
        u = g_rows @ down
        gw[token, slot] = (u * hidden).sum(-1).to(gw.dtype)
        g_hidden = u * w
        g_down[e] = ((g_rows * w).t() @ hidden).to(g_down[e].dtype)
        g_a, = torch.autograd.grad(s, a_in, g_hidden * b)
        g_b = g_hidden * s.detach()
        gx.index_add_(0, token, (g_a @ gate + g_b @ up).to(x.dtype))
        g_gate[e], g_up[e] = (g_a.t() @ rows).to(g_gate[e].dtype), (g_b.t() @ rows).to(
            g_up[e].dtype)
    return gx, None, gw, g_gate, g_up, g_down, None


routed_experts.register_autograd(_backward, setup_context=_setup)


def routed_experts_rule(c: OpCall) -> OpRule:
    """Tokens ``t`` split freely, the experts' hidden units ``f`` give partial sums; the model
    width ``h`` (inside the activation) and the slots ``k`` stay whole (module docstring).
    FLOPs: three products of (T k, H, F), whatever the routing (the backward's recomputation:
    `cost/compute.BACKWARD_FACTORS`)."""
    (t, h), (_, k) = c.in_shapes[:2]
    num = (len(c.in_shapes) - 3) // 3
    f = c.in_shapes[3][0]
    dims = [["t", "h"], ["t", "k"], ["t", "k"]] + [["f", "h"]] * (2 * num) + [["h", "f"]] * num
    sig = sized(dims, ["t", "h"], c.in_shapes, c.out_shape, "contraction",
                unsplittable={"h", "k"})
    return OpRule("routed_experts", sig, 3 * 2.0 * t * k * h * f)
