"""A step of M micro-batches as one full-batch step (issue 25): how each of the loss's
reductions over the batch is weighted.

The runtime averages the M micro-batch losses (weight 1/M each), which is the full batch's loss
only when every reduction over the batch in it is a mean over a fixed count. It is not for a sum
(the full batch's is the sum of the micro-batches', not their mean), nor for a mean whose count
depends on the data: a cross-entropy with ``ignore_index`` (-100 labels on padding) or class
``weight=`` divides by the real targets *of its micro-batch*, so micro-batches with more padding
weigh too much. Hugging Face's models compute exactly that loss.

`batch_reductions` finds the loss's reductions over the batch (the reductions whose operands
carry the batch and whose result does not) and checks that the loss is linear in them (sums, negation,
scaling by what does not depend on the batch); each gets a scale the local program multiplies
its result by, given per micro-batch by `micro_scales`:

- a mean over a fixed count: 1 (micro-batches are equal cuts);
- a sum: M;
- an NLL mean: M · c_m / Σ c, where c_m counts micro-batch m's real targets (weighted by their
  classes' weights). Every rank holds the whole batch, so each counts every micro-batch's
  targets itself before the first one runs (`TargetCounter`: the traced program's own steps
  from the batch to the NLL's target), with no communication.

Averaged with weight 1/M, each then contributes its full-batch share: the step's loss,
gradients and update are one full-batch forward and backward's. A loss that is not linear in
its batch reductions (a reduction after a non-linear function of another, a max over the batch)
cannot be cut into micro-batches exactly: planning says so and the micro-batches are averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from meshplan.ir.graph import Graph, Node

# Ops through which the loss stays linear in a reduction's result: (op, operands that may
# carry a reduction; the others must not depend on the batch).
_LINEAR: Mapping[str, tuple[int, ...] | None] = {
    "add": None, "sub": None, "neg": (0,), "mul": (0, 1), "div": (0,), "_to_copy": (0,),
    "clone": (0,), "view": (0,), "reshape": (0,), "_unsafe_view": (0,), "squeeze": (0,),
    "unsqueeze": (0,), "expand": (0,), "alias": (0,), "sum": (0,), "mean": (0,),
}
KINDS = ("mean", "sum", "nll_mean", "nll_sum")


@dataclass(frozen=True)
class BatchReduction:
    """A reduction over the batch in the loss: IR node ``node`` of ``kind`` (`KINDS`)."""

    node: str
    kind: str


@dataclass(frozen=True)
class Reductions:
    """The loss's reductions over the batch, or why micro-batches cannot make it exactly
    (``inexact``: a sentence; then ``found`` is empty and micro-batches are averaged)."""

    found: tuple[BatchReduction, ...] = ()
    inexact: str | None = None


def _batch_dims(graph: Graph) -> dict[str, frozenset[int]]:
    from meshplan.planner.intra.choices import batch_dims
    return batch_dims(graph)


def batch_reductions(graph: Graph) -> Reductions:
    """The loss's reductions over the batch (module docstring)."""
    bdims = _batch_dims(graph)
    carries = {n.name: bool(bdims[n.name]) for n in graph.nodes}
    # Which values depend on the batch at all (a reduction's result no longer carries it, but
    # depends on it).
    depends: dict[str, bool] = {}
    for n in graph.nodes:
        depends[n.name] = n.role in ("input", "target") or any(depends[i] for i in n.inputs)
    found: list[BatchReduction] = []
    reduced: set[str] = set()         # values holding a reduction's result, linearly
    for n in graph.nodes:
        if n.is_source:
            continue
        batch_in = [i for i in n.inputs if carries[i]]
        reduces = n.sig is not None and n.sig.kind == "reduction"
        if reduces and batch_in and not carries[n.name]:
            kind = _kind(n)
            if kind is None:
                return Reductions(inexact=f"the loss reduces the batch by {n.op!r} ({n.name}), "
                                          "which is not a sum or mean")
            if any(i in reduced for i in n.inputs):
                return Reductions(inexact=f"{n.op!r} ({n.name}) reduces what another batch "
                                          "reduction already made")
            found.append(BatchReduction(n.name, kind))
            reduced.add(n.name)
            continue
        touched = [j for j, i in enumerate(n.inputs) if i in reduced]
        if not touched:
            continue
        allowed = _LINEAR.get(n.op, ())
        if n.op in ("add", "sub"):
            ok = all(not depends[i] or i in reduced for i in n.inputs)
        else:
            ok = allowed is not None and all(j in allowed for j in touched) and \
                all(not depends[i] for j, i in enumerate(n.inputs) if j not in touched)
        if not ok:
            return Reductions(inexact=f"the loss applies {n.op!r} ({n.name}) to a reduction "
                                      "over the batch, which micro-batches cannot add up")
        reduced.add(n.name)
    if graph.loss not in reduced and depends.get(graph.loss, False):
        return Reductions(inexact="the loss depends on the batch other than through sums and "
                                  "means of it")
    return Reductions(tuple(found))


def _kind(n: Node) -> str | None:
    mean = n.sig is not None and bool(n.sig.mean_atoms)
    if n.op == "nll_loss":
        return "nll_mean" if mean else "nll_sum"
    if n.op in ("mean", "sum", "mse_loss"):
        return "mean" if mean else "sum"
    return None


# ---------------------------------------------------------------- counting targets
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)

class TargetCounter:
    """Counts an NLL's real targets in a batch on the host: the traced program's own steps
    from the batch tensors to the NLL's target (a shift, a reshape), then the targets not
    equal to ``ignore_index`` (weighted: the sum of their classes' weights)."""

    def __init__(self, traced: fx.GraphModule, nll: str, sources: Mapping[str, str]) -> None:
        by_name = {n.name: n for n in traced.graph.nodes}
        node = by_name[nll]
        args = list(node.args) + [None] * 5
        target, weight = args[1], args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        self.ignore = args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        wanted = [a for a in (target, weight) if isinstance(a, fx.Node)]
        keep: dict[fx.Node, None] = {}

        def visit(x: fx.Node) -> None:
            if x in keep:
                return
            for a in x.all_input_nodes:
                visit(a)
            keep[x] = None
        for w in wanted:
            visit(w)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[str] = []
        for x in keep:
            if x.op == "placeholder":
                if x.name not in sources:
                    raise ValueError(f"the NLL's target depends on {x.name}, not only on the "
                                     "batch")
                self.inputs.append(sources[x.name])
                env[x] = g.placeholder(x.name)
            else:
                env[x] = g.node_copy(x, lambda a: env[a])
                if x.target in _VIEWS:   # a batch piece may be strided where the trace's was not
                    env[x].target = torch.ops.aten.reshape.default
        g.output((env[target], env[weight] if isinstance(weight, fx.Node) else None))
        self._program = fx.GraphModule(traced, g)

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> float:
        target, weight = self._program(*[tensors[k].contiguous() for k in self.inputs])
        t = target.reshape(-1)
        real = t != self.ignore
        if weight is None:
            return float(real.sum())
        return float(weight.double()[t.clamp(min=0)][real].sum())


def micro_scales(reductions: Sequence[BatchReduction], counters: Mapping[str, TargetCounter],
                 micro_tensors: Sequence[Mapping[str, torch.Tensor]]) -> list[list[float]]:
    """Per micro-batch, each reduction's scale (module docstring)."""
    m = len(micro_tensors)
    out = [[1.0] * len(reductions) for _ in range(m)]
    for k, r in enumerate(reductions):
        if r.kind in ("sum", "nll_sum"):
            for row in out:
                row[k] = float(m)
        elif r.kind == "nll_mean":
            counts = [counters[r.node](t) for t in micro_tensors]
            total = sum(counts)
            for row, c in zip(out, counts):
                row[k] = m * c / total if total else 1.0
    return out


def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A reduction's result times its micro-batch scale (a 0-dim tensor on its device)."""
    return x * scale.to(x.dtype)




def _terminals(graph: Graph) -> list[Node]:
    """The nodes the loss is a linear combination of (walking back from it through the ops of
    `_LINEAR`), in program order."""
    out: dict[str, None] = {}
    todo, seen = [graph.loss], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        n = graph.by_name[name]
        if n.op in _LINEAR and not n.is_source:
            todo.extend(n.inputs)
        elif not n.is_source:
            out[name] = None
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return sorted((graph.by_name[k] for k in out), key=lambda n: order[n.name])


def _mapped(found: Reductions, whole: Graph, graph: Graph) -> Reductions | None:
    """``found`` (the reductions of the program traced on the whole batch) as the same nodes
    of ``graph`` (traced on one micro-batch), matched by their place among the loss's terms;
    None where the two programs' terms differ."""
    terms, mine = _terminals(whole), _terminals(graph)
    if [n.op for n in terms] != [n.op for n in mine] or \
            not {r.node for r in found.found} <= {n.name for n in terms}:
        return None
    place = {n.name: i for i, n in enumerate(terms)}
    return Reductions(tuple(BatchReduction(mine[place[r.node]].name, r.kind)
                            for r in found.found))


class StepScales:
    """The loss's batch reductions of a traced program and, per step, each micro-batch's
    scale for each (`micro_scales`); ``inexact`` says why there are none to make.

    ``whole`` gives the program traced on the whole batch, asked for when the micro-batch's
    own program does not show its batch (a micro-batch of one sample: its size-1 batch dim
    folds into the next one, and the reductions over it are no longer visible as such): its
    reductions are then matched to the micro-batch program's by their place in the loss."""

    def __init__(self, traced: fx.GraphModule, graph: Graph,
                 whole: Callable[[], Graph] | None = None) -> None:
        found = batch_reductions(graph)
        if found.inexact is not None and whole is not None:
            full = whole()
            seen = batch_reductions(full)
            if seen.inexact is None:
                found = _mapped(seen, full, graph) or found
        sources = {n.name: n.state_name for n in graph.nodes
                   if n.role in ("input", "target") and n.state_name}
        counters: dict[str, TargetCounter] = {}
        try:
            for r in found.found:
                if r.kind == "nll_mean":
                    counters[r.node] = TargetCounter(traced, r.node, sources)
        except ValueError as e:
            found = Reductions(inexact=str(e))
            counters = {}
        self.reductions, self.inexact = found.found, found.inexact
        self._counters = counters

    def __call__(self, micro: Sequence[object]) -> list[dict[str, float]]:
        """Per micro-batch of a step (global micro-batches, in the batch's form), each
        reduction's scale by node."""
        from meshplan.capture.batch import flatten_batch
        rows = micro_scales(self.reductions, self._counters,
                            [flatten_batch(m)[1] for m in micro])
        return [{r.node: s for r, s in zip(self.reductions, row)} for row in rows]
