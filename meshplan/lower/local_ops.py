"""Emit one traced op into a rank's local program, with local arguments where the op needs them.

Most aten ops run unchanged on local shards. The exceptions are ops whose arguments name global
sizes (views and expands take the rank's local shape) and means over a split dim, which become a
local sum divided by the global count so the result is a partial sum.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch import fx

from meshplan.capture.signature_rules import CONSTANT_OPS
from meshplan.ir.graph import Node
from meshplan.runtime import collectives, step_casts

aten = torch.ops.aten

SHAPE_ARG_OPS = frozenset({"view", "_unsafe_view", "reshape", "expand"})

# Per local program: the local call of each multi-output op, by (traced op, local operands).
_MULTI_OUTPUT_CALLS: "weakref.WeakKeyDictionary[fx.Graph, dict]" = weakref.WeakKeyDictionary()


def _packet(target: Any) -> str:
    return getattr(target, "__name__", str(target)).split(".")[0]


def _substitute(args: tuple, kwargs: dict, operands: Sequence[fx.Node]) -> tuple[tuple, dict]:
    """Replace the traced operand nodes, in order of appearance, by the local ones."""
    it = iter(operands)

    def sub(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return next(it)
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    new_args = tuple(sub(a) for a in args)
    new_kwargs = {k: sub(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _nll_count(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The local part of a mean NLL's divisor: the targets not equal to ``ignore_index``,
    weighted by their class weight. Detached, as torch's own total weight is."""
    keep = target != ignore_index
    if weight is None:
        return keep.sum(dtype=dtype)
    w = weight.detach()[target.clamp(0, max(weight.shape[0] - 1, 0))]
    return (w * keep.to(dtype)).sum(dtype=dtype)


def cast_float(x: Any, dtype: torch.dtype) -> Any:
    """``x`` at ``dtype`` if autocast would cast it (a floating tensor other than float64),
    else unchanged (integer indices, a float64 program); a parameter's cast made once per step
    where the runtime keeps them (`runtime/step_casts.py`)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        casts = step_casts.active()
        kept = casts.cast(x, dtype) if casts is not None and x.dtype != dtype else None
        return kept if kept is not None else x.to(dtype)
    return x


def nll_loss_synced(comm: Any, x: torch.Tensor, target: torch.Tensor, weight: Any,
                    ignore_index: int, axes: tuple[int, ...], micro: bool = False
                    ) -> torch.Tensor:
    """This rank's share of a mean NLL over a batch split across ``axes``: the local sum over
    the targets divided by the global count of non-ignored targets (weighted), one scalar
    all-reduced over ``axes`` (the plan's collective for the loss's statistics)."""
    total = aten.nll_loss_forward(x, target, weight, 2, ignore_index)[0]
    count = _nll_count(target, weight, ignore_index, x.dtype)
    return _nll_mean(total, collectives.all_reduce(comm, count, axes) if axes else count, micro)


def _nll_mean(total: torch.Tensor, count: torch.Tensor, micro: bool) -> torch.Tensor:
    """``total / count``. In a micro-batch (``micro``) the count may be 0, every target
    ignored: then ``total`` is 0 and so is the mean, whose scale (`microbatch.py`) is 0 too,
    where 0 / 0 would make the whole step's loss and gradients NaN. One device sees the whole
    batch, whose count is the sum of the micro-batches'."""
    if micro:
        count = torch.where(count == 0, torch.ones_like(count), count)
    return total / count


def mse_loss_split_mean(a: torch.Tensor, b: torch.Tensor, count: int) -> torch.Tensor:
    return aten.mse_loss(a, b, 2) / count


def sum_split_mean(x: torch.Tensor, dims: Any, keepdim: bool, count: int) -> torch.Tensor:
    if dims is None or len(dims) == 0:
        return aten.sum.default(x) / count
    return aten.sum.dim_IntList(x, dims, keepdim) / count


def _split_mean(g: fx.Graph, packet: str, node: Node, args: tuple) -> fx.Node:
    count = math.prod(node.sig.size(a) for a in node.sig.mean_atoms)
    if packet == "mse_loss":
        return g.call_function(mse_loss_split_mean, (args[0], args[1], count))
    if packet == "mean":
        dims = args[1] if len(args) > 1 else None
        keep = args[2] if len(args) > 2 else False
        return g.call_function(sum_split_mean, (args[0], dims, keep, count))
    raise AssertionError(f"no split-mean rule for {packet}")


def sync_batch_norm(comm: Any, x: torch.Tensor, weight: Any, bias: Any, running_mean: Any,
                    running_var: Any, momentum: float, eps: float, axes: tuple[int, ...],
                    count: int) -> torch.Tensor:
    """Training batch norm over a batch split across ``axes``: the per-channel mean, then the
    per-channel squared deviations, are all-reduced, so every rank normalizes with the
    statistics of the whole batch (single-device semantics); the backward all-reduces carry the
    gradients of the statistics."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    # Two passes, as torch does on one device: E[x²] − E[x]² loses the variance to
    # cancellation when channels have a large mean and few elements.
    # Statistics accumulate in float64, as torch's CPU kernels do for float32 inputs: a batch
    # split over ranks must not lose the precision the single-device program has (and the
    # all-reduced sums have one size whatever the input's dtype, as the plan counts them).
    acc = torch.float64
    total = collectives.all_reduce(comm, x.sum(dims, dtype=acc), axes, backward="all_reduce")
    mean = (total / count).to(x.dtype)
    centered = x - mean.view(shape)
    sq = collectives.all_reduce(comm, (centered * centered).sum(dims, dtype=acc), axes,
                                backward="all_reduce")
    var = (sq / count).to(x.dtype)
    out = centered * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    out = out.to(x.dtype)   # torch's batch norm keeps the input's dtype under fp32 parameters
    if running_mean is not None and not comm.recomputing:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.detach() * (count / max(count - 1, 1)),
                                                alpha=momentum)
    return out


def batch_norm_once(comm: Any, target: Any, x: torch.Tensor, *args: Any) -> Any:
    """Batch norm (``target``: aten's) whose running statistics a replay of the forward in
    backward does not update again: one device's forward updates them once."""
    if comm.recomputing and len(args) > 3 and args[2] is not None:   # updates thrown away
        args = (args[0], args[1], args[2].clone(), args[3].clone(), *args[4:])
    return target(x, *args)


def _batch_norm(g: fx.Graph, args: tuple, node: Node, comm: fx.Node, axes: tuple[int, ...]
                ) -> fx.Node:
    # ``args`` are native_batch_norm's (x, weight, bias, running_mean, running_var, training,
    # momentum, eps) with local operands substituted; the optional tensors may be None.
    x, w, b, rm, rv, _, momentum, eps = (*args, *[None] * (8 - len(args)))
    count = node.out.numel // node.out.shape[1]
    return g.call_function(sync_batch_norm, (comm, x, w, b, rm, rv, momentum, eps, axes, count))


def emit(g: fx.Graph, orig: fx.Node, node: Node, operands: Sequence[fx.Node],
         out_shape: tuple[int, ...], partial: bool, comm: fx.Node | None = None,
         sync_axes: tuple[int, ...] = (), micro: bool = False) -> fx.Node:
    """Append ``orig`` (a traced fx node) to ``g`` over local ``operands``; return its value.
    ``sync_axes``: axes over which the op all-reduces its statistics (batch norm's moments, a
    mean NLL's target count)."""
    if orig.target is operator.getitem:  # one output of a multi-output op: run it locally
        parent = orig.args[0]
        # Outputs of one op over the same local operands share one local call.
        calls = _MULTI_OUTPUT_CALLS.setdefault(g, {})
        key = (parent, tuple(operands))
        if key not in calls:
            args, kwargs = _substitute(parent.args, dict(parent.kwargs), operands)
            calls[key] = g.call_function(parent.target, args, kwargs)
        return g.call_function(operator.getitem, (calls[key], orig.args[1]))
    args, kwargs = _substitute(orig.args, dict(orig.kwargs), operands)
    packet = _packet(orig.target)
    mean = packet == "nll_loss_forward" and (args[3] if len(args) > 3 else 1) == 1
    if mean and (sync_axes or micro):
        weight = args[2] if len(args) > 2 else None
        ignore = args[4] if len(args) > 4 else -100
        return g.call_function(nll_loss_synced, (comm, args[0], args[1], weight, ignore,
                                                 sync_axes, micro))
    if sync_axes:
        assert packet == "native_batch_norm", packet
        return _batch_norm(g, args, node, comm, sync_axes)
    if packet == "native_batch_norm" and comm is not None:
        value = g.call_function(batch_norm_once, (comm, orig.target, *args), kwargs)
        return g.call_function(operator.getitem, (value, 0))
    target = orig.target
    if packet == "convolution" and len(args) > 8 and args[8] != 1:
        # A grouped convolution split over whole groups runs this rank's groups only.
        args = (*args[:8], args[8] * out_shape[1] // node.out.shape[1], *args[9:])
    if packet in SHAPE_ARG_OPS:
        args = (args[0], list(out_shape), *args[2:])
    if packet in ("view", "_unsafe_view"):
        # A local shard may be strided where the global tensor was contiguous (a slice of
        # a split dim), so views become reshapes: a view when possible, else a copy.
        target = aten.reshape.default
    if partial and node.sig is not None and node.sig.mean_atoms:
        return _split_mean(g, packet, node, args)
    if packet == "copy":  # aten.copy has no derivative; its meaning does
        return g.call_function(functional_copy, args[:2])
    if packet in CONSTANT_OPS:
        # A factory's tensor operands (linspace's start and end) are values, as eager's
        # torch.linspace treats them: its aten overload has no derivative for them.
        args, kwargs = fx.node.map_arg((args, kwargs),
                                       lambda a: g.call_function(aten.detach.default, (a,)))
    value = g.call_function(target, args, kwargs)
    if isinstance(orig.meta.get("val"), (tuple, list)):
        value = g.call_function(operator.getitem, (value, 0))
    return value


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
              is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
              scale: float | None = None) -> tuple[torch.Tensor, None]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (what a CPU trace records for
    ``scaled_dot_product_attention``) on any device: the same attention by the device's own
    kernel choice. Its second output, the log-sum-exp only that kernel's backward reads, is
    not made."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out, None


def functional_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``aten.copy(dst, src)`` (a functionalized ``dst.copy_(src)``) as differentiable ops:
    src cast to dst's dtype and broadcast to its shape; dst's values are not read."""
    return src.to(dst.dtype).expand(dst.shape).clone()


# The buffer writes of the forward running in this thread (`buffer_writes`).
_WRITES = threading.local()


@contextlib.contextmanager
def buffer_writes() -> Iterator[dict[str, torch.Tensor]]:
    """Within: the forward's buffer writes (`write_buffer`), by the buffer's state name, in
    the dict given; the caller commits them after the forward. A replay of the forward in
    backward (recomputation) runs outside and writes nothing: it reads the buffers its
    forward read, and one device updates them once."""
    before = getattr(_WRITES, "pending", None)
    _WRITES.pending = pending = {}
    try:
        yield pending
    finally:
        _WRITES.pending = before


@torch.fx.node.has_side_effect
def write_buffer(name: str, buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The forward's ``buffer.copy_(value)`` (`ir.graph.BUFFER_WRITE`): the new value,
    cast and broadcast as copy_ does, recorded for `buffer_writes`' caller. The buffer itself
    is not written: a micro-batch's forward and its replay read the value it had."""
    new = value.detach().to(buffer.dtype).expand(buffer.shape).clone()
    pending = getattr(_WRITES, "pending", None)
    if pending is not None:
        pending[name] = new
    return new


def dropout_like_one_device(x: torch.Tensor, p: float, train: bool | None,
                            rng: Any, global_shape: tuple[int, ...],
                            offsets: tuple[tuple[int, int], ...], node: str = ""
                            ) -> torch.Tensor:
    """Dropout whose mask is this rank's piece of the mask one device would draw.

    torch's CPU dropout draws ``bernoulli(1 - p)`` over the whole input and scales by
    ``1 / (1 - p)``; drawing the same global mask from a generator seeded like the single-device
    run and keeping this rank's piece gives identical results on any sharding (at the price of
    drawing the whole mask on every rank). On a GPU the mask is drawn there, from the rank's
    CUDA generator: every plan draws the same masks as a one-device run of meshplan, though
    not the bits of CUDA's fused dropout kernel. ``rng`` may be the step's
    `runtime.dropout.DropoutStream` (several micro-batches or pipeline stages): dropout
    ``node``'s mask is then the micro-batch's rows of the whole batch's.
    """
    if not train or p == 0:
        return x * 1.0
    if p >= 1:
        return x * 0.0
    if hasattr(rng, "mask"):
        mask = rng.mask(node, x.dtype, x.device)
    else:
        mask = torch.empty(global_shape, dtype=x.dtype, device=x.device).bernoulli_(
            1 - p, generator=rng)
    for d, (start, length) in enumerate(offsets):
        mask = mask.narrow(d, start, length)
    return x * mask * (1.0 / (1 - p))


def bernoulli_like_one_device(target: Any, x: torch.Tensor, args: tuple, kwargs: dict,
                              rng: Any, node: str) -> torch.Tensor:
    """A ``bernoulli`` draw (the whole tensor, as every rank draws it: `random_rule`) from the
    step's generator, or from its `runtime.dropout.DropoutStream`: IR node ``node``'s mask of
    the current micro-batch, the rows of the whole batch's."""
    if hasattr(rng, "mask"):
        return rng.mask(node, x.dtype, x.device)
    return target(x, *args, **kwargs, generator=rng)


def emit_dropout(g: fx.Graph, orig: fx.Node, x: fx.Node, rng: fx.Node,
                 global_shape: tuple[int, ...], offsets: tuple[tuple[int, int], ...],
                 node: str) -> fx.Node:
    """``native_dropout(x, p, train)`` (IR node ``node``) as `dropout_like_one_device` on the
    local piece."""
    p = orig.args[1] if len(orig.args) > 1 else orig.kwargs.get("p")
    train = orig.args[2] if len(orig.args) > 2 else orig.kwargs.get("train")
    return g.call_function(dropout_like_one_device, (x, p, train, rng, tuple(global_shape),
                                                     offsets, node))


def constant_like(kind: str, shape: tuple[int, ...], dtype: str, fill: Any, *,
                  device: torch.device) -> torch.Tensor:
    """``*_like`` and ``new_*`` constants (their shape and dtype come from another tensor, or
    are given) made whole on ``device``, of the *global* shape and the traced dtype."""
    dt = getattr(torch, dtype)
    if kind in ("full_like", "new_full"):
        return torch.full(shape, fill, dtype=dt, device=device)
    if kind in ("ones_like", "new_ones"):
        return torch.ones(shape, dtype=dt, device=device)
    # empty: zeros, so a rank never reads garbage
    return torch.zeros(shape, dtype=dt, device=device)


def fill_value(kind: str, orig: fx.Node) -> Any:
    """The fill of a traced ``full_like(x, fill)`` / ``new_full(x, size, fill)``, else None."""
    position = {"full_like": 1, "new_full": 2}.get(kind)
    if position is None:
        return None
    return orig.args[position] if len(orig.args) > position else orig.kwargs["fill_value"]


def materialize_constant(value: torch.Tensor) -> torch.Tensor:
    """A real copy of a tensor constant kept in the traced program (make_fx stores the real
    tensor it met; a fake one would mean the constant was computed under tracing)."""
    from meshplan.torch_api import is_fake
    if is_fake(value):
        raise AssertionError("meshplan internal error: a traced tensor constant is fake")
    return value.detach().clone()


def vocab_parallel_embedding(weight: torch.Tensor, idx: torch.Tensor, start: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Lookup in this rank's rows ``[start, start + rows)`` of the table; other ids give zeros,
    so the sum over ranks is the full lookup (the result is a partial sum). The row of
    ``padding_idx`` (a global id) gets no gradient, as on one device."""
    local = idx - start
    rows = weight.shape[0]
    inside = (local >= 0) & (local < rows)
    pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows else -1
    out = aten.embedding.default(weight, local.clamp(0, max(rows - 1, 0)), pad)
    return out * inside.unsqueeze(-1).to(out.dtype)


def softmax_split(comm: Any, x: torch.Tensor, dim: int, axes: tuple[int, ...], log: bool
                  ) -> torch.Tensor:
    """(log-)softmax over a dim split across ``axes``: the rows' maxima are gathered (detached:
    any shift gives the same exact result) and the sums of exponentials all-reduced."""
    n = comm.group_size(axes)
    local_max = x.detach().amax(dim, keepdim=True)
    maxima = collectives.all_gather(comm, local_max, axes, dim, [1] * n)
    shifted = x - maxima.amax(dim, keepdim=True)
    total = collectives.all_reduce(comm, shifted.exp().sum(dim, keepdim=True), axes,
                                   backward="all_reduce")
    return shifted - total.log() if log else shifted.exp() / total


def nll_loss_class_split(comm: Any, x: torch.Tensor, target: torch.Tensor, weight: Any,
                         start: int, ignore_index: int, reduction: int, axes: tuple[int, ...],
                         micro: bool = False) -> torch.Tensor:
    """NLL over log-probabilities whose class dim is split: each rank picks the targets that
    fall in its classes ``[start, start + C_local)`` (``weight``: its classes' weights); the
    result is a partial sum, per row under reduction "none" (0). A mean (1) divides by the
    count of non-ignored targets (weighted), all-reduced over ``axes`` (those splitting the
    batch, and the classes when weighted)."""
    local = target - start
    inside = (local >= 0) & (local < x.shape[1])
    rows = local.clamp(0, max(x.shape[1] - 1, 0))
    picked = x.gather(1, rows.unsqueeze(1)).squeeze(1) * inside.to(x.dtype)
    keep = target != ignore_index
    w = weight[rows] * (inside & keep).to(x.dtype) if weight is not None else \
        keep.to(x.dtype)
    if reduction == 0:
        return -(picked * w)
    total = -(picked * w).sum()
    if reduction == 2:
        return total
    count = w.detach().sum() if weight is not None else keep.sum(dtype=x.dtype)
    return _nll_mean(total, collectives.all_reduce(comm, count, axes) if axes else count, micro)
