"""Every aten graph captures: op families written as people write them, each captured with a
signature, planned (ILP with unit costs, data, megatron) and trained equal to one device."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.zoo.spec import Workload
from oracle import SGD, assert_matches, reference, train_rank

B, S, H = 4, 8, 16


class Pointwise(nn.Module):
    """Rotary-style cos/sin, clamp, pow, boolean masks and integer position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.pos = nn.Embedding(S, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)   # int64 flows
        h = self.lin(x) + self.pos(ids)
        mask = torch.logical_not((h > 0.5) & (h < -0.5)) | torch.bitwise_and(ids, 1).bool()[..., None]
        h = torch.where(mask, h, torch.zeros_like(h))
        return torch.cos(h) * torch.sin(h).clamp(-0.5, 0.5) + h.pow(2) * 0.1 + torch.rsqrt(h * h + 1)


class KVCache(nn.Module):
    """A key/value cache that starts as the 1-D empty tensor torch.cat accepts next to keys."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, H // 2).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        past = torch.empty(0)
        k = torch.cat([past, k], dim=-2)
        v = torch.cat([past, v], dim=-2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class MultiOutput(nn.Module):
    """Secondary outputs read by the forward: topk/sort/max indices, var_mean, list outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        vals, idx = h.topk(4, dim=-1)
        m, arg = h.max(dim=-1)
        var, mean = torch.var_mean(h, dim=-1, keepdim=True)
        _, ln_mean, ln_rstd = torch.native_layer_norm(h, [H], None, None, 1e-5)
        srt, order = torch.sort(h, dim=1)
        a, b = torch.chunk(h, 2, dim=-1)
        pieces = torch.split(h, [4, 12], dim=-1)
        first, *_ = h.unbind(1)
        extra = (idx.float().mean(-1) + arg.float() + order.float().mean(-1)) * 0.01
        out = (h - mean) / (var + 1).sqrt() + torch.cat([b, a], -1) + srt * 0.1 \
            + (h - ln_mean) * ln_rstd
        return out + (vals.sum(-1) + m + extra)[..., None] + pieces[0].sum(-1, keepdim=True) \
            + first[:, None, :]


class Indexing(nn.Module):
    """gather, index.Tensor, index_select and scatter_add with integer intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.table = nn.Parameter(torch.randn(10, H) * 0.1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        idx = h.argmax(-1, keepdim=True).expand(-1, -1, 4)
        g = torch.gather(h, 2, idx)                                           # (B, S, 4)
        looked = self.table[ids] + torch.index_select(self.table, 0, ids.flatten()).view(h.shape)
        sc = torch.zeros_like(h).scatter_add(2, idx, g * 2)
        put = torch.zeros(10, H)
        rows = ids[0] * 0 + torch.arange(S) + 1                               # unique rows
        put[rows] = h[0]                                                      # index_put
        return h + looked + sc + g.sum(-1, keepdim=True) + put[:S].unsqueeze(0)


class IndexLayouts(nn.Module):
    """Advanced indexing as torch orders it: index tensors apart (their dims go first),
    broadcast against each other, next to slices; and padding (constant, reflect, replicate)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(B, S, 2, H // 2)
        rows = ids[0, :2].view(2, 1) % S                                      # (2, 1)
        heads = torch.arange(2).view(2, 1)                                    # (2, 1)
        cols = ids[0, :4].view(1, 4) % (H // 2)                               # (1, 4)
        apart = h[:, rows, :, cols]                                           # (2, 4, B, 2)
        together = h[:, :, heads, cols]                                       # (B, S, 2, 4)
        mix = apart.sum((0, 1))[:, None, :, None] + together
        flat = mix.flatten(2)                                                 # (B, S, 8)
        p = F.pad(mix, (1, 1))[..., 1:-1].flatten(2)
        r = F.pad(flat, (1, 1), mode="replicate")[..., 1:-1]
        q = F.pad(flat.transpose(1, 2), (2, 2), mode="reflect").transpose(1, 2)[:, 2:-2]
        return (p + r + q).repeat(1, 1, 2)


class Constants(nn.Module):
    """new_ones / new_full / arange, a plain tensor attribute, in-place and out= ops."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.scale = torch.linspace(0.5, 1.5, H)   # not a buffer: a tensor constant of the trace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        h = h + h.new_ones(h.shape[-1]) + h.new_full((1, 1, H), 0.5)
        ramp = torch.empty(H)
        torch.mul(torch.arange(H, dtype=h.dtype), 0.5, out=ramp)   # out= (no grad: allowed)
        y = h * 2
        y.add_(ramp)
        y.mul_(0.5).relu_()
        return y


class ViewWrites(nn.Module):
    """In-place writes into views (functionalized into select/slice_scatter and copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 1.0
        h[:, 0] += 1.0
        h[..., 2:6] *= 2
        h[:, -1].copy_(h[:, 1])
        return h + h[:, :, 3:4]


class MaskedAttention(nn.Module):
    """Attention with a padding mask (batch-shaped, broadcast over heads and queries) and an
    additive per-head bias (ALiBi/T5 style, broadcast over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.heads = 4
        slopes = torch.tensor([2.0 ** -(i + 1) for i in range(self.heads)])
        dist = torch.arange(S)[None, :] - torch.arange(S)[:, None]
        self.register_buffer("alibi", (slopes[:, None, None] * dist).unsqueeze(0))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        pad = keep[:, None, None, :].bool()                                  # (B, 1, 1, S)
        o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
        o2 = F.scaled_dot_product_attention(q, k, v, attn_mask=self.alibi)   # (1, h, S, S)
        return (o1 + o2).transpose(1, 2).reshape(b, s, H)


class BatchedMatmul(nn.Module):
    """matmul of 4-D tensors and einsums with several batch dims."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, H // 2, H // 2) * 0.2)
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(x.shape[0], x.shape[1], 2, H // 2).transpose(1, 2)  # (B, 2, S, 8)
        att = torch.matmul(h, h.transpose(-1, -2)) * 0.1                          # (B, 2, S, S)
        y = torch.matmul(att.softmax(-1), h)
        y = torch.einsum("bgsd,gde->bgse", y, self.w)
        return y.transpose(1, 2).reshape(x.shape)


def _inputs(model: nn.Module, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(B, S, H, generator=g)
    if isinstance(model, (Indexing, IndexLayouts)):
        return x, torch.randint(0, 10, (B, S), generator=g)
    if isinstance(model, MaskedAttention):
        keep = torch.ones(B, S, dtype=torch.int64)
        keep[1, 5:] = 0
        keep[3, 2:] = 0
        return x, keep
    return (x,)


CASES: dict[str, Callable[[], nn.Module]] = {
    "pointwise": Pointwise, "kv-cache": KVCache, "multi-output": MultiOutput,
    "indexing": Indexing, "index-layouts": IndexLayouts, "constants": Constants, "view-writes": ViewWrites, "masked-attention": MaskedAttention,
    "batched-matmul": BatchedMatmul,
}


def _workload(case: str) -> tuple[Workload, list[Any]]:
    torch.manual_seed(0)
    model = CASES[case]()
    g = torch.Generator().manual_seed(1)
    data = [(_inputs(model, g), torch.randn(B, S, H, generator=g)) for _ in range(2)]
    return Workload(model, F.mse_loss, data[0], case), data


def check_trains_like_one_device(w: Workload, data: list[Any], shape: tuple[int, int],
                                 method: str, **kw: Any) -> Any:
    """Plan, train on emulated ranks (each rank capturing for itself) and compare."""
    extra = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, f"local:{math.prod(shape)}",
                    mesh_shape=shape, method=method, memory_budget_gb=0, **extra, **kw)
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, shape, plan, w, data):
        assert_matches(r, ref, plan, SGD)
    return plan


@pytest.mark.parametrize("case", list(CASES))
def test_captures_with_every_op_signed(case: str) -> None:
    w, _ = _workload(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, graph = capture(w.model, w.loss_fn, w.example_batch)
    assert graph.unsupported_ops == ()


RUNS = [(method, shape) for method in ("auto", "data", "megatron") for shape in ((1, 2), (2, 2))]


@pytest.mark.parametrize("method,shape", RUNS, ids=[f"{m}-{s[0]}x{s[1]}" for m, s in RUNS])
@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_one_device(case: str, method: str, shape: tuple[int, int]) -> None:
    w, data = _workload(case)
    check_trains_like_one_device(w, data, shape, method)
