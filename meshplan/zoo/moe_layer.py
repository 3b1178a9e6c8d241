"""GShard's mixture-of-experts layer: top-2 gating with per-group capacity, einsum dispatch/combine.

Shapes: G groups of T tokens of width M, E experts of hidden width H, C slots per expert per group.
Every group is routed on its own — capacity is counted per group — so splitting the groups over
devices never changes which tokens are dropped. The transformer makes each sequence a group.

Routing (GShard, Lepikhin et al. 2020, Algorithm 1), with the expert dimension E leading every
expert weight so that expert parallelism is a split of that dimension:
  probs = softmax(x @ wg)                         (G, T, E)
  top-1 expert e1 with prob p1; top-2 expert e2 (best of the rest) with prob p2
  a token's slot in e1's buffer is the number of earlier top-1 tokens of its group sent to e1; in
  e2's buffer it comes after all of the group's top-1 tokens for e2; a slot >= C drops that choice
  gates p1, p2 of the kept choices, normalised to sum to 1
  dispatch (G, T, E, C) in {0, 1}; combine = dispatch weighted by the gates
  y = combine . expert_e(dispatch . x)            (G, T, M)
A token whose two choices are both dropped gets y = 0 (the residual carries it unchanged).
Only ops meshplan traces to signatures are used: einsum, softmax, max(dim), eq/lt, cumsum, sum,
broadcast arithmetic, gelu — no gather, scatter, one_hot or data-dependent shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# GShard's normalisation epsilon: a token with both choices dropped gets gates 0/eps = 0.
_GATE_EPS = 1e-9
_INIT_STD = 0.02


def capacity_slots(capacity: float, tokens_per_group: int, num_experts: int) -> int:
    """Slots per expert per group: ``int(capacity * 2 * T / E)``, at least 1 (2 = top-2 choices).

    Raises ValueError if ``capacity`` <= 0 or a count < 1.
    """
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    if tokens_per_group < 1 or num_experts < 1:
        raise ValueError(f"tokens_per_group and num_experts must be >= 1, got {tokens_per_group}, {num_experts}")
    return max(1, int(capacity * 2 * tokens_per_group / num_experts))


def _one_hot(index: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    # eq against an arange broadcasts to a one-hot without aten.one_hot (which has no signature).
    return (index.unsqueeze(-1) == torch.arange(size, device=index.device, dtype=index.dtype)).to(dtype)


def _slot_one_hot(mask: Tensor, position: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """Keep-mask (G,T,E) of the choices below capacity and their slots as one-hot (G,T,E,C)."""
    keep = mask * (position < slots).to(mask.dtype)
    slot = (position * keep).sum(-1)  # (G, T): the kept choice's slot, 0 when dropped
    return keep, keep.unsqueeze(-1) * _one_hot(slot, slots, mask.dtype).unsqueeze(-2)


def top2_routing(probs: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """GShard top-2 routing of ``probs`` (G, T, E) into ``slots`` slots per expert per group.

    Returns ``(dispatch, combine)``, both (G, T, E, C): dispatch is 1 where a token occupies a
    slot, combine is dispatch times the token's normalised gate for that expert.
    """
    num_experts = probs.shape[-1]
    p1, i1 = probs.max(-1)
    m1 = _one_hot(i1, num_experts, probs.dtype)
    p2, i2 = (probs * (1 - m1)).max(-1)
    m2 = _one_hot(i2, num_experts, probs.dtype)
    # Positions count per group (dim 1 = tokens); top-2 choices queue behind all top-1 choices.
    pos1 = torch.cumsum(m1, dim=1) * m1 - m1
    pos2 = (torch.cumsum(m2, dim=1) + m1.sum(1, keepdim=True)) * m2 - m2
    keep1, d1 = _slot_one_hot(m1, pos1, slots)
    keep2, d2 = _slot_one_hot(m2, pos2, slots)
    gate1 = p1 * keep1.sum(-1)
    gate2 = p2 * keep2.sum(-1)
    norm = gate1 + gate2 + _GATE_EPS
    gate1, gate2 = gate1 / norm, gate2 / norm
    combine = gate1[..., None, None] * d1 + gate2[..., None, None] * d2
    return d1 + d2, combine  # e1 != e2, so d1 + d2 stays in {0, 1}


class MoELayer(nn.Module):
    """E expert FFNs (M -> H -> M, exact GELU) behind a top-2 gate, over (groups, tokens, M).

    Parameters: ``wg`` (M, E) gate without bias; ``w_in`` (E, M, H), ``b_in`` (E, H),
    ``w_out`` (E, H, M), ``b_out`` (E, M). All start N(0, 0.02), like the GPT's Linears.
    Raises ValueError if a size < 1 or ``capacity`` <= 0.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, capacity: float) -> None:
        super().__init__()
        if min(hidden, ffn_hidden, num_experts) < 1:
            raise ValueError(f"MoELayer sizes must be >= 1, got {hidden}, {ffn_hidden}, {num_experts}")
        if not capacity > 0:
            raise ValueError(f"MoELayer capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.wg = nn.Parameter(torch.empty(hidden, num_experts))
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.b_in = nn.Parameter(torch.empty(num_experts, ffn_hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.b_out = nn.Parameter(torch.empty(num_experts, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every parameter from N(0, 0.02) (a no-op on the meta device)."""
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=_INIT_STD)

    def forward(self, x: Tensor) -> Tensor:
        """Route ``x`` (G, T, M) to the experts and combine their outputs into (G, T, M)."""
        slots = capacity_slots(self.capacity, x.shape[1], self.wg.shape[1])
        probs = torch.softmax(torch.einsum("gtm,me->gte", x, self.wg), dim=-1)
        dispatch, combine = top2_routing(probs, slots)
        xe = torch.einsum("gtec,gtm->egcm", dispatch, x)
        h = F.gelu(torch.einsum("egcm,emh->egch", xe, self.w_in) + self.b_in[:, None, None, :])
        ye = torch.einsum("egch,ehm->egcm", h, self.w_out) + self.b_out[:, None, None, :]
        return torch.einsum("gtec,egcm->gtm", combine, ye)


def moe_layer_params(hidden: int, ffn_hidden: int, num_experts: int) -> int:
    """Scalar parameters of ``MoELayer(hidden, ffn_hidden, num_experts, ...)``."""
    return hidden * num_experts + num_experts * (2 * hidden * ffn_hidden + ffn_hidden + hidden)
