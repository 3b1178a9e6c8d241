"""Adafactor on local shards: torch.optim.Adafactor's update of the whole parameter, computed
piecewise.

Each rank steps the piece of every parameter it updates. Where torch's update sums over a whole
dimension or the whole parameter, the rank sums over its piece and the all-reduces of
`meshplan.lower.factored_stats` complete the sums over the ranks holding the other pieces. With no
split at all it is torch's algorithm (`_single_tensor_adafactor`) step for step; the oracle tests
check it against torch's own optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from meshplan.lower.factored_stats import Axes, Bucket, factored_buckets
from meshplan.runtime.comm import Comm
from meshplan.runtime.optim import OptimizerSpec


@dataclass
class _State:
    step: int = 0
    row_var: torch.Tensor | None = None
    col_var: torch.Tensor | None = None
    variance: torch.Tensor | None = None


class ShardedAdafactor:
    """Adafactor of ``spec`` over the local ``tensors`` (leaf tensors with ``.grad``), pieces of
    parameters of ``full_shapes`` split over the mesh axes ``dims`` (per dim, `update_dims`)."""

    def __init__(self, spec: OptimizerSpec, tensors: Sequence[torch.Tensor],
                 full_shapes: Sequence[tuple[int, ...]], dims: Sequence[tuple[Axes, ...]],
                 comm: Comm) -> None:
        if spec.kind != "adafactor":
            raise ValueError(f"ShardedAdafactor steps Adafactor, not {spec.kind!r}")
        self.spec, self.comm = spec, comm
        self.tensors, self.full_shapes = list(tensors), [tuple(s) for s in full_shapes]
        self.buckets = factored_buckets(self.full_shapes, dims, comm.mesh_shape)
        self.state = [_State() for _ in self.tensors]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.tensors:
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        spec = self.spec
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.tensors]
        # Round 1: the parameter's sum of squares, and each row's and column's Σ g².
        partial = {}
        for i, (t, g) in enumerate(zip(self.tensors, grads)):
            partial[(i, "param_sq")] = t.pow(2).sum().reshape(1)
            if g.dim() > 1:
                sq = g * g
                partial[(i, "row")] = sq.sum(dim=-1, keepdim=True)
                partial[(i, "col")] = sq.sum(dim=-2, keepdim=True)
        self._complete(1, partial)
        for i, (t, g) in enumerate(zip(self.tensors, grads)):
            st, full = self.state[i], self.full_shapes[i]
            st.step += 1
            weight = st.step ** spec.beta2_decay
            rho = min(spec.lr, 1 / st.step ** 0.5)
            rms = math.sqrt(partial[(i, "param_sq")].item()) / max(math.prod(full), 1) ** 0.5
            partial[(i, "alpha")] = torch.tensor(max(spec.eps2, rms) * rho)
            if spec.weight_decay:
                t.mul_(1 - spec.lr * spec.weight_decay)
            if g.dim() > 1:
                if st.row_var is None:
                    st.row_var = torch.zeros_like(partial[(i, "row")])
                    st.col_var = torch.zeros_like(partial[(i, "col")])
                st.row_var.lerp_(partial[(i, "row")] / full[-1], weight)
                st.col_var.lerp_(partial[(i, "col")] / full[-2], weight)
                partial[(i, "row_sum")] = st.row_var.sum(dim=-2, keepdim=True)
            else:
                if st.variance is None:
                    st.variance = torch.zeros_like(g)
                st.variance.lerp_(g * g, weight)
        # Round 2: the mean of the row statistics, over every row.
        self._complete(2, partial)
        for i, (t, g) in enumerate(zip(self.tensors, grads)):
            st, full = self.state[i], self.full_shapes[i]
            eps1 = spec.eps1 if spec.eps1 is not None else torch.finfo(t.dtype).eps
            if g.dim() > 1:
                var = st.row_var @ st.col_var
                var.div_((partial[(i, "row_sum")] / full[-2]).clamp_(min=eps1))
            else:
                var = st.variance.clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
            partial[(i, "update")] = update
            partial[(i, "update_sq")] = update.pow(2).sum().reshape(1)
        # Round 3: the update's sum of squares, for its RMS clipping.
        self._complete(3, partial)
        for i, t in enumerate(self.tensors):
            numel = max(math.prod(self.full_shapes[i]), 1)
            rms = math.sqrt(partial[(i, "update_sq")].item()) / numel ** 0.5
            denom = max(1.0, rms / self.spec.d)
            t.add_(partial[(i, "update")], alpha=-partial[(i, "alpha")].item() / denom)

    def _complete(self, rnd: int, partial: dict) -> None:
        """Sums the round's partial sums over the ranks holding the other pieces, in place."""
        for b in self.buckets:
            if b.round == rnd:
                self._reduce(b, partial)

    def _reduce(self, bucket: Bucket, partial: dict) -> None:
        flat = torch.zeros(bucket.numel, dtype=torch.float32, device=self.comm.device)
        at = 0
        for p in bucket.pieces:
            v = partial[(p.param, p.what)].reshape(-1)
            if v.numel() > p.numel:
                raise NotImplementedError(
                    "Adafactor on shards larger than an even split's (uneven axis weights) is "
                    "not supported; use even weights or an elementwise optimizer (Adam, SGD)")
            flat[at:at + v.numel()] = v
            at += p.numel
        flat = self.comm.all_reduce(flat, bucket.axes, phase="update")
        at = 0
        for p in bucket.pieces:
            v = partial[(p.param, p.what)]
            partial[(p.param, p.what)] = flat[at:at + v.numel()].reshape(v.shape).to(v.dtype)
            at += p.numel
