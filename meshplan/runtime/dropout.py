"""Dropout masks of a step of several micro-batches or pipeline stages, as one device draws
them for the whole batch.

One device runs the whole batch's forward once: each dropout draws its mask over the whole
batch from the step's generator, one after the other in program order. A rank running the
step as micro-batches (or one pipeline stage's part of it) draws fewer, smaller masks from its
generator, so its masks would be other random masks. `DropoutStream` gives it the very masks
one device draws: at the step's start it walks the whole program's dropouts in order, noting
the generator's state before each and drawing each whole-batch mask to advance the generator
as one device does (`sites`); a micro-batch's dropout then restarts the generator at its own
state, draws the whole-batch mask and keeps its micro-batch's rows along the dim that carries
the batch (the batch outermost: a merged batch-and-sequence dim keeps a contiguous block).
A dropout of what carries no batch (a weight's) gets the one mask every micro-batch shares.

This costs the whole batch's masks once per step and once per micro-batch (a dropout a stage
runs). Its state (`get_state`) is the micro-batch running, so a recomputation replays the
masks of the micro-batch it replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from meshplan.ir.graph import Graph


@dataclass(frozen=True)
class DropoutSite:
    """One random mask of the program (IR node ``node``: a dropout, or the ``bernoulli(p)``
    draw a traced dropout becomes), each element 1 with probability ``keep``: one device draws
    it in ``whole`` shape for the whole batch, a micro-batch's mask (``shape``) is the
    ``micro``-th block of ``block`` along ``batch_dim`` (None: no batch, as a weight's mask,
    the same for every micro-batch)."""

    node: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    keep: float
    batch_dim: int | None
    whole: tuple[int, ...]
    block: int


def sites(graph: Graph, traced: fx.GraphModule, microbatches: int,
          shown: Callable[[], tuple[fx.GraphModule, Graph, int]] | None = None,
          other: Callable[[], tuple[fx.GraphModule, Graph, int]] | None = None
          ) -> list[DropoutSite]:
    """The random masks ``graph`` (traced at one micro-batch, at its compute dtype) draws, in
    program order. A micro-batch of one sample hides its batch (a size-1 dim folds away):
    ``shown`` then gives a trace of a few samples (module, graph, samples) whose masks show
    where it runs. A mask the IR finds no batch in is checked on ``other``, a trace at
    another count of samples: a dim whose size changes carries the batch after all. Raises
    NotImplementedError for a mask whose batch runs along two dims (its micro-batch's mask is
    no block of the whole batch's) or a ``bernoulli`` of a tensor of probabilities (the other
    micro-batches' probabilities are not at hand)."""
    found = _draws(graph, traced)
    if not found:
        return []
    if shown is None and other is not None and any(f[4] is None for f in found):
        o_traced, o_graph, _ = other()
        seen = _draws(o_graph, o_traced)
        if len(seen) == len(found):
            found = [_seen_batch(f, o[1]) if f[4] is None else f for f, o in zip(found, seen)]
    if shown is not None:
        s_traced, s_graph, samples = shown()
        seen = _draws(s_graph, s_traced)
        if len(seen) != len(found):
            raise NotImplementedError(
                "the program draws other random masks at one sample per micro-batch than at "
                f"{samples}: train with micro-batches of several samples")
        out = []
        for (node, shape, dtype, keep, _), (_, s_shape, _, _, dim) in zip(found, seen):
            if dim is None:
                out.append(DropoutSite(node, shape, dtype, keep, None, shape, 0))
                continue
            each = s_shape[dim] // samples   # one sample's extent along the batch's dim
            whole = tuple(each * microbatches if d == dim else n for d, n in enumerate(s_shape))
            out.append(DropoutSite(node, shape, dtype, keep, dim, whole, each))
        return out
    return [DropoutSite(node, shape, dtype, keep, dim,
                        shape if dim is None else tuple(n * microbatches if d == dim else n
                                                        for d, n in enumerate(shape)),
                        0 if dim is None else shape[dim])
            for node, shape, dtype, keep, dim in found]


def _seen_batch(draw: tuple, other_shape: tuple[int, ...]) -> tuple:
    """A mask the IR found no batch in, its batch dim from its shape at another batch size."""
    node, shape, dtype, keep, _ = draw
    changed = [d for d, (a, b) in enumerate(zip(shape, other_shape)) if a != b]
    if len(changed) > 1 or len(shape) != len(other_shape):
        raise NotImplementedError(
            f"dropout {node} changes shape with the batch along dims {changed}: its "
            "micro-batch's mask is not a block of the whole batch's; train with one micro-batch")
    return (node, shape, dtype, keep, changed[0] if changed else None)


def _draws(graph: Graph, traced: fx.GraphModule) -> list[tuple]:
    """(node, shape, dtype, keep, batch dim or None) of each random mask, in program order."""
    from meshplan.planner.intra.choices import batch_dims
    fx_nodes = {n.name: n for n in traced.graph.nodes}
    batched = batch_dims(graph)
    out = []
    for n in graph.nodes:
        if n.op not in ("native_dropout", "bernoulli"):
            continue
        orig = fx_nodes[n.name]
        p = orig.args[1] if len(orig.args) > 1 else orig.kwargs.get("p")
        if n.op == "native_dropout":
            train = orig.args[2] if len(orig.args) > 2 else orig.kwargs.get("train")
            if not train or not 0 < p < 1:   # draws nothing (`dropout_like_one_device`)
                continue
            keep = 1 - float(p)
        elif not isinstance(p, (int, float)):
            raise NotImplementedError(
                f"{n.name} draws bernoulli of a tensor of probabilities: over several "
                "micro-batches or pipeline stages meshplan cannot draw one device's masks "
                "for it; train with one micro-batch and one stage, or use nn.Dropout")
        else:
            keep = float(p)
        dims = sorted(batched.get(n.name, ()) or _shaped_like(orig, batched))
        if len(dims) > 1:
            raise NotImplementedError(
                f"dropout {n.name} runs the batch along dims {dims}: its micro-batch's mask "
                "is not a block of the whole batch's; train with one micro-batch")
        out.append((n.name, tuple(n.out.shape), getattr(torch, n.out.dtype), keep,
                    dims[0] if dims else None))
    return out


def _shaped_like(draw: fx.Node, batched: dict[str, frozenset[int]]) -> frozenset[int]:
    """The batch dims of what a mask is drawn in the shape of: a traced dropout draws
    ``bernoulli(empty_like(x))``, an empty tensor that carries no batch itself."""
    source = draw.args[0] if draw.args else None
    if isinstance(source, fx.Node) and "_like" in str(source.target) and source.args:
        source = source.args[0]
    # Through what the IR folds into its producer (a tuple output's getitem: layer norm's).
    while isinstance(source, fx.Node) and source.name not in batched and source.args \
            and isinstance(source.args[0], fx.Node):
        source = source.args[0]
    return batched.get(source.name, frozenset()) if isinstance(source, fx.Node) \
        else frozenset()


class DropoutStream:
    """The step's dropout masks at ``sites`` as one device draws them for the whole batch
    (module docstring); passed to the local programs in place of a generator."""

    def __init__(self, sites: list[DropoutSite]) -> None:
        self._sites = {s.node: s for s in sites}   # in program order
        self._states: dict[str, torch.Tensor] = {}
        self._gen: torch.Generator | None = None
        self._micro = 0

    def begin(self, generator: torch.Generator) -> DropoutStream:
        """A step starting from ``generator`` (seeded as one device's): every dropout's
        state noted, the generator advanced through the whole batch's masks."""
        self._gen, self._states = generator, {}
        for s in self._sites.values():
            self._states[s.node] = generator.get_state()
            torch.empty(s.whole, dtype=s.dtype, device=generator.device).bernoulli_(
                s.keep, generator=generator)
        self._micro = 0
        return self

    def get_state(self) -> int:
        return self._micro

    def set_state(self, micro: int) -> None:
        """The micro-batch the next masks are for."""
        self._micro = int(micro)

    def mask(self, node: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Dropout ``node``'s mask of the current micro-batch (its whole micro-batch shape,
        before any rank takes its piece)."""
        s = self._sites.get(node)
        if s is None or self._gen is None:
            raise AssertionError(f"meshplan internal error: dropout {node} is not one of the "
                                 "step's dropouts")
        self._gen.set_state(self._states[s.node])
        whole = torch.empty(s.whole, dtype=s.dtype, device=self._gen.device).bernoulli_(
            s.keep, generator=self._gen)
        if s.batch_dim is not None:
            whole = whole.narrow(s.batch_dim, self._micro * s.block, s.block).reshape(s.shape)
        return whole.to(device=device, dtype=dtype)


def stream_for(traced: fx.GraphModule, graph: Graph, dtype: str, microbatches: int,
               batch: Any, recapture: Callable[[Any], tuple]) -> DropoutStream | None:
    """The step's `DropoutStream` for a program traced at one micro-batch of the global
    ``batch`` (``recapture(b)``: the (Traced, Graph) capture of a batch ``b``), or None when
    it draws no mask."""
    from meshplan.capture.batch import batch_size, split_microbatches
    from meshplan.cost.precision import with_compute_dtype
    size, rows = batch_size(batch), batch_size(batch) // microbatches

    def at(samples: int) -> Callable[[], tuple[fx.GraphModule, Graph, int]]:
        def trace() -> tuple[fx.GraphModule, Graph, int]:
            t, g = recapture(split_microbatches(batch, size // samples)[0])
            return t.graph_module, with_compute_dtype(g, dtype), samples
        return trace
    counts = [d for d in range(2, size + 1) if size % d == 0]
    # Micro-batches of one sample hide the batch; a few samples show it. Another count of
    # samples than the micro-batch's checks a mask where the IR sees no batch.
    few = at(counts[0]) if rows == 1 and counts else None
    other = next((at(d) for d in counts if d != rows), None)
    found = sites(with_compute_dtype(graph, dtype), traced, microbatches, few, other)
    return DropoutStream(found) if found else None

