"""Autograd-aware collectives: what lowering inserts between the local ops of a rank program.

Each collective is a ``torch.autograd.Function`` whose backward is its communication twin
(DESIGN.md §3 decision 2): all-gather ↔ reduce-scatter, identity ↔ all-reduce, split ↔
all-gather, all-to-all ↔ the reverse all-to-all. The forward records phase "forward" on the
comm, the backward phase "backward". Shards are cut with ``torch.tensor_split`` semantics
(:func:`shard_sizes`) but every function takes explicit per-member ``sizes``, so uneven shards
(HAP) work everywhere.

Where a backward has two variants, the choice says what the incoming gradient is:

- ``all_reduce(backward="identity")`` (Megatron's g): the output feeds replicated work, so each
  member's gradient is already the whole gradient. ``"all_reduce"``: the output feeds split
  work, so members hold partial gradients that must be summed.
- ``all_gather(backward="slice")``: replicated downstream, keep my piece (no communication).
  ``"reduce_scatter"``: partial gradients (ZeRO-3 / FSDP gather).
- ``split(backward="all_gather")``: the input is a replicated tensor whose gradient must be whole
  on every member. ``"none"``: return my gradient zero-padded into place, a partial gradient.

``all_gather`` and ``reduce_scatter`` take ``impl`` ("padded" or "broadcast", see
:mod:`meshplan.runtime.comm`); their backward twin uses the same impl, since the uneven sizes
that made the choice are the same in both directions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

from meshplan.runtime.comm import Comm, check_impl

_ALL_REDUCE_BACKWARDS = ("identity", "all_reduce")
_ALL_GATHER_BACKWARDS = ("slice", "reduce_scatter")
_SPLIT_BACKWARDS = ("all_gather", "none")


def shard_sizes(size: int, n: int) -> list[int]:
    """Lengths of the ``n`` pieces ``torch.tensor_split`` cuts ``size`` into (the first
    ``size % n`` pieces are one longer). Raises ValueError unless size >= 0 and n >= 1."""
    if not isinstance(size, int) or not isinstance(n, int) or size < 0 or n < 1:
        raise ValueError(f"need size >= 0 and n >= 1, got size={size!r}, n={n!r}")
    base, extra = divmod(size, n)
    return [base + 1 if m < extra else base for m in range(n)]


def local_slice(t: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Piece ``index`` of ``t`` cut along ``dim`` into ``sizes`` (a view). Raises ValueError if
    ``sizes`` does not sum to ``t.shape[dim]`` or ``dim`` or ``index`` is out of range."""
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    if sum(sizes) != t.shape[dim]:
        raise ValueError(f"sizes {list(sizes)} do not sum to {t.shape[dim]} (dim {dim})")
    if not 0 <= index < len(sizes):
        raise ValueError(f"index {index} out of range for {len(sizes)} pieces")
    return t.narrow(dim, sum(sizes[:index]), sizes[index])


def all_reduce(
    comm: Comm, x: torch.Tensor, axes: Sequence[int], *, backward: str = "identity"
) -> torch.Tensor:
    """P→R: sum ``x`` over the group. ``backward`` is "identity" or "all_reduce" (module doc)."""
    _check_choice("backward", backward, _ALL_REDUCE_BACKWARDS)
    return _AllReduce.apply(x, comm, tuple(axes), backward == "all_reduce")


def grad_all_reduce(comm: Comm, x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's f): mark a replicated tensor that
    feeds split work, whose gradient arrives partial on each member."""
    return _GradAllReduce.apply(x, comm, tuple(axes))


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward, gradient times ``factor`` backward: a use whose complete gradient is
    summed again, identical, over a group of n members contributes 1/n of it (a tied
    parameter's use computed whole, see `meshplan.planner.intra.fanout.param_sync`)."""
    return _GradScale.apply(x, float(factor))


def all_gather(
    comm: Comm,
    x: torch.Tensor,
    axes: Sequence[int],
    dim: int,
    sizes: Sequence[int],
    *,
    backward: str = "slice",
    impl: str = "padded",
) -> torch.Tensor:
    """S→R: concatenate the members' shards along ``dim`` (``sizes[m]`` = member m's length).
    ``backward`` is "slice" or "reduce_scatter" (module doc); ``impl`` is "padded" or
    "broadcast", for the forward and a reduce-scatter backward alike. Raises ValueError on
    a bad choice."""
    _check_choice("backward", backward, _ALL_GATHER_BACKWARDS)
    check_impl(impl)
    return _AllGather.apply(
        x, comm, tuple(axes), dim, tuple(sizes), backward == "reduce_scatter", impl
    )


def reduce_scatter(
    comm: Comm, x: torch.Tensor, axes: Sequence[int], dim: int, sizes: Sequence[int], *,
    impl: str = "padded",
) -> torch.Tensor:
    """P→S: sum over the group, keep my piece of ``dim`` cut by ``sizes``; backward all-gather,
    both by ``impl`` ("padded" or "broadcast"). Raises ValueError on an unknown impl."""
    check_impl(impl)
    return _ReduceScatter.apply(x, comm, tuple(axes), dim, tuple(sizes), impl)


def split(
    comm: Comm,
    x: torch.Tensor,
    axes: Sequence[int],
    dim: int,
    sizes: Sequence[int],
    *,
    backward: str = "all_gather",
) -> torch.Tensor:
    """R→S: my piece of ``dim`` cut by ``sizes`` (a copy, no communication, nothing recorded).
    ``backward`` is "all_gather" or "none" (module doc). Raises ValueError on bad sizes."""
    _check_choice("backward", backward, _SPLIT_BACKWARDS)
    return _Split.apply(x, comm, tuple(axes), dim, tuple(sizes), backward == "all_gather")


def all_to_all(
    comm: Comm,
    x: torch.Tensor,
    axes: Sequence[int],
    split_dim: int,
    split_sizes: Sequence[int],
    concat_dim: int,
    concat_sizes: Sequence[int],
) -> torch.Tensor:
    """S(concat_dim)→S(split_dim): cut my ``x`` along ``split_dim`` into ``split_sizes``, send
    piece m to member m, concatenate along ``concat_dim`` (member m holds ``concat_sizes[m]``
    of it). Backward is the reverse all-to-all."""
    return _AllToAll.apply(
        x, comm, tuple(axes), split_dim, tuple(split_sizes), concat_dim, tuple(concat_sizes)
    )


class _AllReduce(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, comm: Comm, axes: tuple[int, ...], reduce_grad: bool
    ) -> torch.Tensor:
        ctx.comm, ctx.axes, ctx.reduce_grad = comm, axes, reduce_grad
        return comm.all_reduce(x, axes, phase="forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.reduce_grad:
            grad = ctx.comm.all_reduce(grad, ctx.axes, phase="backward")
        return grad, None, None, None


class _GradAllReduce(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, comm: Comm, axes: tuple[int, ...]
    ) -> torch.Tensor:
        comm.group_size(axes)  # validates axes now rather than in backward
        ctx.comm, ctx.axes = comm, axes
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.all_reduce(grad, ctx.axes, phase="backward"), None, None


class _GradScale(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad * ctx.factor, None


class _AllGather(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        comm: Comm,
        axes: tuple[int, ...],
        dim: int,
        sizes: tuple[int, ...],
        reduce_grad: bool,
        impl: str,
    ) -> torch.Tensor:
        out = comm.all_gather(x, axes, dim, sizes, phase="forward", impl=impl)
        ctx.comm, ctx.axes, ctx.dim, ctx.sizes = comm, axes, dim, sizes
        ctx.reduce_grad, ctx.impl = reduce_grad, impl
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        comm, axes, dim, sizes = ctx.comm, ctx.axes, ctx.dim, ctx.sizes
        if ctx.reduce_grad:
            piece = comm.reduce_scatter(grad, axes, dim, sizes, phase="backward", impl=ctx.impl)
        else:
            piece = local_slice(grad, dim, sizes, comm.group_index(axes)).contiguous()
        return piece, None, None, None, None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        comm: Comm,
        axes: tuple[int, ...],
        dim: int,
        sizes: tuple[int, ...],
        impl: str,
    ) -> torch.Tensor:
        ctx.comm, ctx.axes, ctx.dim, ctx.sizes, ctx.impl = comm, axes, dim, sizes, impl
        return comm.reduce_scatter(x, axes, dim, sizes, phase="forward", impl=impl)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        whole = ctx.comm.all_gather(
            grad, ctx.axes, ctx.dim, ctx.sizes, phase="backward", impl=ctx.impl
        )
        return whole, None, None, None, None, None


class _Split(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        comm: Comm,
        axes: tuple[int, ...],
        dim: int,
        sizes: tuple[int, ...],
        gather_grad: bool,
    ) -> torch.Tensor:
        n = comm.group_size(axes)
        if len(sizes) != n:
            raise ValueError(f"split: sizes must have {n} entries (one per member), got {sizes}")
        piece = local_slice(x, dim, sizes, comm.group_index(axes))
        ctx.comm, ctx.axes, ctx.dim, ctx.sizes = comm, axes, dim, sizes
        ctx.full_shape, ctx.gather_grad = x.shape, gather_grad
        # A copy, not a view: custom-Function outputs that alias inputs complicate autograd.
        return piece.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        comm, axes, dim, sizes = ctx.comm, ctx.axes, ctx.dim, ctx.sizes
        if ctx.gather_grad:
            whole = comm.all_gather(grad, axes, dim, sizes, phase="backward")
        else:
            whole = grad.new_zeros(ctx.full_shape)
            local_slice(whole, dim, sizes, comm.group_index(axes)).copy_(grad)
        return whole, None, None, None, None, None


class _AllToAll(Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        comm: Comm,
        axes: tuple[int, ...],
        split_dim: int,
        split_sizes: tuple[int, ...],
        concat_dim: int,
        concat_sizes: tuple[int, ...],
    ) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        ctx.dims, ctx.sizes = (split_dim, concat_dim), (split_sizes, concat_sizes)
        return comm.all_to_all(
            x, axes, split_dim, split_sizes, concat_dim, phase="forward", concat_sizes=concat_sizes
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (split_dim, concat_dim), (split_sizes, concat_sizes) = ctx.dims, ctx.sizes
        back = ctx.comm.all_to_all(
            grad, ctx.axes, concat_dim, concat_sizes, split_dim,
            phase="backward", concat_sizes=split_sizes,
        )
        return back, None, None, None, None, None, None


def resplit(
    comm: Comm,
    x: torch.Tensor,
    axes: Sequence[int],
    dim: int,
    sizes: Sequence[int],
    new_sizes: Sequence[int],
) -> torch.Tensor:
    """S(dim) cut by ``sizes`` → S(dim) cut by ``new_sizes`` (`Comm.resplit`); backward moves
    the gradient back to ``sizes``."""
    return _Resplit.apply(x, comm, tuple(axes), dim, tuple(sizes), tuple(new_sizes))


class _Resplit(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, comm: Comm, axes: tuple[int, ...], dim: int,
                sizes: tuple[int, ...], new_sizes: tuple[int, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes, ctx.dim, ctx.sizes = comm, axes, dim, (sizes, new_sizes)
        return comm.resplit(x, axes, dim, sizes, new_sizes, phase="forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sizes, new_sizes = ctx.sizes
        back = ctx.comm.resplit(grad, ctx.axes, ctx.dim, new_sizes, sizes, phase="backward")
        return back, None, None, None, None, None


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
