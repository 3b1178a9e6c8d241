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
  from the batch to the NLL's target), with no communication. A micro-batch without a real
  target has scale 0 and its mean is taken as 0, not 0/0 (`local_ops._nll_mean`).

Averaged with weight 1/M, each then contributes its full-batch share: the step's loss,
gradients and update are one full-batch forward and backward's.

A reduction over the batch of what does not depend on the parameters — a statistic of the data,
such as the count of real tokens a hand-written masked mean divides by, ``(tok *
mask).sum() / mask.sum()`` — is not scaled: every micro-batch's program takes the whole batch's
value in its place (``stat_*`` kinds: a sum, mean, max or min, computed on the host from each
micro-batch's own and combined, `HostProgram`). It then no longer varies between micro-batches,
so the loss may use it in any way (divide by it, clamp it). A loss that is not linear in its
other batch reductions (a reduction after a non-linear function of another, a max over the
batch of what the parameters make) cannot be cut into micro-batches exactly: planning says so
and the micro-batches are averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from meshplan.ir.graph import BUFFER_WRITE, Graph, Node

# Ops through which the loss stays linear in a reduction's result: (op, operands that may
# carry a reduction; the others must not depend on the batch).
_LINEAR: Mapping[str, tuple[int, ...] | None] = {
    "add": None, "sub": None, "neg": (0,), "mul": (0, 1), "div": (0,), "_to_copy": (0,),
    "clone": (0,), "view": (0,), "reshape": (0,), "_unsafe_view": (0,), "squeeze": (0,),
    "unsqueeze": (0,), "expand": (0,), "alias": (0,), "sum": (0,), "mean": (0,),
}
KINDS = ("mean", "sum", "nll_mean", "nll_sum", "stat_sum", "stat_mean", "stat_max", "stat_min")
# How the whole batch's statistic follows from its micro-batches' (equal cuts).
_COMBINE: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "stat_sum": lambda v: v.sum(0), "stat_mean": lambda v: v.mean(0),
    "stat_max": lambda v: v.amax(0), "stat_min": lambda v: v.amin(0)}
_STAT_OPS = {"sum": "stat_sum", "mean": "stat_mean", "amax": "stat_max", "max": "stat_max",
             "amin": "stat_min", "min": "stat_min"}


@dataclass(frozen=True)
class BatchReduction:
    """A reduction over the batch in the loss: IR node ``node`` of ``kind`` (`KINDS`)."""

    node: str
    kind: str

    @property
    def statistic(self) -> bool:
        """Whether it is a statistic of the data, whose whole-batch value replaces it."""
        return self.kind in _COMBINE


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
    learned: dict[str, bool] = {}     # depends on the parameters
    # Which values differ between micro-batches: what depends on the batch (a reduction's
    # result no longer carries it, but depends on it), except the data's statistics, which
    # take the whole batch's value.
    depends: dict[str, bool] = {}
    found: list[BatchReduction] = []
    reduced: set[str] = set()         # values holding a reduction's result, linearly
    for n in graph.nodes:
        learned[n.name] = n.role == "param" or any(learned[i] for i in n.inputs)
        depends[n.name] = n.role in ("input", "target") or any(depends[i] for i in n.inputs)
        if n.is_source:
            continue
        batch_in = [i for i in n.inputs if carries[i]]
        if n.op == BUFFER_WRITE:
            buffer = graph.by_name[n.inputs[0]].state_name
            return Reductions(inexact=f"the forward updates buffer {buffer!r} (a running "
                                      "statistic, a counter) once per micro-batch, where one "
                                      "device updates it once a step")
        if carries[n.name] and _mixes_samples(n, bdims):
            return Reductions(inexact=f"{n.op!r} ({n.name}) computes each sample's value from "
                                      "the whole batch (batch norm's statistics in training, "
                                      "a softmax over the batch): a micro-batch's would come "
                                      "from its own samples")
        if n.op in _STAT_OPS and batch_in and not carries[n.name] and not learned[n.name]:
            found.append(BatchReduction(n.name, _STAT_OPS[n.op]))
            depends[n.name] = False
            continue
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


def _mixes_samples(n: Node, bdims: Mapping[str, frozenset[int]]) -> bool:
    """Whether op ``n`` mixes the samples of the batch it keeps: a batch atom of its operands
    that it normalizes over (its statistics, `StatSync`) or cannot be split on."""
    from meshplan.planner.intra.choices import op_batch_atoms
    if n.sig is None:
        return False
    over = n.sig.sync.sync_atoms if n.sig.sync is not None else frozenset()
    return bool(op_batch_atoms(n, bdims) & (over | n.sig.unsplittable))


def _kind(n: Node) -> str | None:
    mean = n.sig is not None and bool(n.sig.mean_atoms)
    if n.op == "nll_loss":
        return "nll_mean" if mean else "nll_sum"
    if n.op in ("mean", "sum", "mse_loss"):
        return "mean" if mean else "sum"
    return None


# ---------------------------------------------------------------- counting targets
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)

class HostProgram:
    """The traced program's own steps from the batch tensors to some of its values (an NLL's
    target after a shift and a reshape, a statistic of the data), run on the host on a
    micro-batch's tensors. ``what`` names the values in the error raised when they depend on
    more than the batch."""

    def __init__(self, traced: fx.GraphModule, wanted: Sequence[fx.Node | None],
                 sources: Mapping[str, str], what: str) -> None:
        keep: dict[fx.Node, None] = {}

        def visit(x: fx.Node) -> None:
            if x in keep:
                return
            for a in x.all_input_nodes:
                visit(a)
            keep[x] = None
        for w in wanted:
            if w is not None:
                visit(w)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[str] = []
        for x in keep:
            if x.op == "placeholder":
                if x.name not in sources:
                    raise ValueError(f"{what} depends on {x.name}, not only on the batch")
                self.inputs.append(sources[x.name])
                env[x] = g.placeholder(x.name)
            else:
                env[x] = g.node_copy(x, lambda a: env[a])
                if x.target in _VIEWS:   # a batch piece may be strided where the trace's was not
                    env[x].target = torch.ops.aten.reshape.default
        g.output(tuple(None if w is None else env[w] for w in wanted))
        self._program = fx.GraphModule(traced, g)

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> tuple:
        return self._program(*[tensors[k].contiguous() for k in self.inputs])


def _node(traced: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in traced.graph.nodes if n.name == name)


class TargetCounter:
    """Counts an NLL's real targets in a batch on the host (`HostProgram`): the targets not
    equal to ``ignore_index`` (weighted: the sum of their classes' weights)."""

    def __init__(self, traced: fx.GraphModule, nll: str, sources: Mapping[str, str]) -> None:
        node = _node(traced, nll)
        args = list(node.args) + [None] * 5
        target, weight = args[1], args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        self.ignore = args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        self._program = HostProgram(
            traced, [target, weight if isinstance(weight, fx.Node) else None], sources,
            "the NLL's target")
        self.inputs = self._program.inputs

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> float:
        target, weight = self._program(tensors)
        t = target.reshape(-1)
        real = t != self.ignore
        if weight is None:
            return float(real.sum())
        return float(weight.double()[t.clamp(min=0)][real].sum())


def micro_scales(reductions: Sequence[BatchReduction], counters: Mapping[str, Callable],
                 micro_tensors: Sequence[Mapping[str, torch.Tensor]]
                 ) -> list[list[float | torch.Tensor]]:
    """Per micro-batch, each reduction's scale, or a statistic's whole-batch value (module
    docstring). ``counters``: an NLL mean's `TargetCounter`, a statistic's `HostProgram`."""
    m = len(micro_tensors)
    out: list[list[float | torch.Tensor]] = [[1.0] * len(reductions) for _ in range(m)]
    for k, r in enumerate(reductions):
        if r.statistic:
            whole = _COMBINE[r.kind](torch.stack([counters[r.node](t)[0]
                                                  for t in micro_tensors]))
            for row in out:
                row[k] = whole
            continue
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


def whole_batch(x: torch.Tensor, whole: torch.Tensor, piece: tuple[tuple[int, int], ...],
                zero: bool) -> torch.Tensor:
    """A statistic's local value ``x`` replaced by the whole batch's, ``whole``: this rank's
    ``piece`` of it ((start, length) per dim, `shards.piece_offsets`), or zeros where ``x`` is
    a partial sum and this rank not the first of its group (the group's sum is the whole, exact
    for integer counts too)."""
    out = whole.to(device=x.device, dtype=x.dtype)
    for d, (start, length) in enumerate(piece):
        out = out.narrow(d, start, length)
    return torch.zeros_like(out) if zero else out.contiguous()


def program_input(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch's scale (fp32) or statistic (its own dtype) as a program argument."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.tensor(value, dtype=torch.float32, device=device)




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
        counters: dict[str, Callable] = {}
        try:
            for r in found.found:
                if r.kind == "nll_mean":
                    counters[r.node] = TargetCounter(traced, r.node, sources)
                elif r.statistic:
                    counters[r.node] = HostProgram(traced, [_node(traced, r.node)], sources,
                                                   f"the data's statistic {r.node}")
        except ValueError as e:
            found = Reductions(inexact=str(e))
            counters = {}
        self.reductions, self.inexact = found.found, found.inexact
        self._counters = counters

    def __call__(self, micro: Sequence[object]) -> list[dict[str, float | torch.Tensor]]:
        """Per micro-batch of a step (global micro-batches, in the batch's form), each
        reduction's scale (a statistic's whole-batch value) by node."""
        from meshplan.capture.batch import flatten_batch
        return self.of_tensors([flatten_batch(m)[1] for m in micro])

    def of_tensors(self, micro: Sequence[Mapping[str, torch.Tensor]],
                   nodes: Sequence[str] | None = None
                   ) -> list[dict[str, float | torch.Tensor]]:
        """As calling it, on each global micro-batch's tensors by batch name (only those
        `inputs_of` ``nodes`` needed), for the reductions ``nodes`` (default: all)."""
        wanted = [r for r in self.reductions if nodes is None or r.node in nodes]
        rows = micro_scales(wanted, self._counters, micro)
        return [{r.node: s for r, s in zip(wanted, row)} for row in rows]

    def inputs_of(self, nodes: Sequence[str]) -> tuple[str, ...]:
        """The batch tensors (by batch name) the scales of reductions ``nodes`` are counted
        from."""
        names: set[str] = set()
        for r in self.reductions:
            counter = self._counters.get(r.node)
            if r.node in nodes and counter is not None:
                names.update(counter.inputs)
        return tuple(sorted(names))
