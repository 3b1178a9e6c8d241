"""Trace forward + loss of an ``nn.Module`` into an aten-level fx graph on fake tensors.

This is the one module that touches torch's tracing internals (``make_fx`` and
``FakeTensorMode``), so a torch upgrade breaks in one place. Nothing is allocated: parameters,
buffers and the example batch become fake *CPU* tensors (fake CUDA breaks autograd on a CPU
build), so a model built on the ``meta`` device traces at any size.

The traced function is the step's loss on the model called with its parameters and buffers
swapped for stand-ins (`stand_ins`: by identity, every slot restored afterwards, so planning
leaves the model as it was) (``capture/batch.py``: the batch forms and the loss conventions);
its placeholders are, in
order, every parameter, every buffer, every batch tensor (positional, keyword, target). The
backward pass is not traced: at run time autograd differentiates the sharded forward program.

The graph is functionalized (in-place and ``out=`` ops become their pure forms) and
``torch.cat``'s legacy empty operands are dropped, so every later pass sees plain values. A trace
that torch refuses (data-dependent shapes, ops without fake-tensor support) ends in a ValueError
naming the op and the module. Tracing holds one process-wide lock: make_fx's patching is global
state, and emulated ranks (threads) may capture at once.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.fx import GraphModule
from torch.func import functionalize

from meshplan.torch_api import (FakeTensorMode, OpOverload, get_proxy_mode, get_proxy_slot,
                                lazy_graph_modules, make_fx)
from meshplan.capture.cse import merge_common_subexpressions
from meshplan.capture.fold_matmul import fold_batched_matmuls
from meshplan.capture.in_place import make_pure, pure_forms
from meshplan.capture.moe_blocks import static_routing
from meshplan.capture.no_grad import GradRecord, detach_where_autograd_stops
from meshplan.capture.saved import SavedForBackward, renamed, same_nodes

from meshplan.capture.batch import BatchLayout, flatten_batch, step_loss
from meshplan.capture.trace_errors import (ModuleStack, explain_trace_failure,
                                          refuse_gradient_hooks)

aten = torch.ops.aten


@dataclass(frozen=True)
class Traced:
    """An fx graph of forward + loss and the meaning of its placeholders.

    ``placeholders[i]`` is ``(role, name)`` for the i-th placeholder node, where ``role`` is
    ``"param"``, ``"buffer"``, ``"input"`` or ``"target"`` and ``name`` the state-dict name (for
    params/buffers) or the batch tensor's name (``"input{i}"``, a keyword, ``"target"``);
    ``batch`` rebuilds the model call from the batch tensors.
    """

    graph_module: GraphModule
    placeholders: tuple[tuple[str, str], ...]
    batch: BatchLayout | None = None
    # Nodes whose values autograd saves for backward (`capture/saved.py`); None: not known.
    saved: frozenset[str] | None = None

    def __reduce__(self) -> tuple:
        # A GraphModule pickles as its code and is traced anew from it: its nodes come back
        # renamed and without their meta (`HALF_BIAS`), so a plan's lowering could not find
        # its ops in it. Refused here rather than failing later on a missing node's name.
        raise TypeError("a meshplan capture cannot be pickled: its fx graph would come back "
                        "renamed and without its node marks; capture the model in each "
                        "process (threads may share one capture)")


# The node meta key of a bias add split from its linear layer or convolution. Autocast runs
# the fused op (addmm, convolution) at its half type, bias included, where a plain add of a
# half product and an fp32 bias would promote to fp32: so the runtime casts such an add's
# operands as a contraction's (`lower/program.py`) and the cost model gives it the half type
# (`cost/precision.py`), and mixed precision runs and is priced as eager autocast runs it.
HALF_BIAS = "meshplan_half_bias"


def _half_bias(out: torch.Tensor) -> torch.Tensor:
    """``out``, its traced node marked `HALF_BIAS`."""
    mode = get_proxy_mode()
    slot = get_proxy_slot(out, mode.tracer, None) if mode is not None else None
    if slot is not None:
        slot.proxy.node.meta[HALF_BIAS] = True
    return out


def _addmm_as_mm_add(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                     beta: float = 1, alpha: float = 1) -> torch.Tensor:
    # The bias of a row-parallel linear must be added after the partial sums are reduced, so
    # the planner needs the matmul and the bias add as two ops (Alpa and Megatron do the same).
    out = aten.mm.default(a, b)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return _half_bias(aten.add.Tensor(out, bias))


def _conv_bias_apart(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *args: Any
                     ) -> Any:
    # As for addmm: a convolution split over input channels yields partial sums, and its bias
    # must be added once, after they are reduced.
    if bias is None:
        return NotImplemented
    out = aten.convolution.default(x, w, None, *args)
    shape = [1, -1] + [1] * (out.dim() - 2)
    return _half_bias(aten.add.Tensor(out, aten.view.default(bias, shape)))


# make_fx patches torch globally while it traces; two threads tracing at once corrupt each other
# (and `stand_ins` swaps the shared model's parameters), so tracing is serialized.
_TRACE_LOCK = threading.Lock()


@contextlib.contextmanager
def _as_a_tracer() -> Iterator[None]:
    """Tell the model it is being traced, as torch.export does: libraries (Hugging Face's mask
    helpers) then skip value-dependent shortcuts (``if torch.all(mask == 1)``) that fake tensors
    cannot answer, and take the path that is the same for every value."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


def _decompositions() -> dict[Any, Callable]:
    return {aten.addmm.default: _addmm_as_mm_add, aten.convolution.default: _conv_bias_apart}


def _as_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    # torch.empty inside the mode gives a fake CPU tensor whatever device t lives on (meta too).
    with mode:
        return torch.empty(t.shape, dtype=t.dtype)


def _make_fx(step: Callable, mode: FakeTensorMode, state: list, batch: list
             ) -> tuple[GraphModule, set[str]]:
    """The model traced as eager runs it, then functionalized (in-place and ``out=`` ops in
    their pure forms) by retracing that aten graph; and the nodes whose values autograd saved
    for backward in the first pass (`capture/saved.py`).

    Two passes, because functionalizing the model directly hides ``requires_grad`` from it, and
    code that reads it (a custom op's "compute the input's gradient" flag, embedding_bag's
    variant) would bake in the choice of a model without gradients. Where functionalization has
    no rule the plain trace is kept: its in-place elementwise ops have signatures of their own."""
    saved = SavedForBackward()
    grads = GradRecord()
    with mode:
        with saved.recording(), _recording_in(step, grads) as traced:
            plain = make_fx(traced, decomposition_table=_decompositions())(state, batch)
        # Values one device's autograd does not differentiate stay constants (`no_grad.py`).
        detach_where_autograd_stops(plain, grads, [*state, *batch])
        if not _mutates(plain):   # already pure: the retrace would copy it
            return plain, _name_placeholders_as_retraced(plain, saved.names)
        forms = pure_forms(_writes(plain))
        if forms:   # only writes no other op sees (`capture/in_place.py`)
            return plain, _name_placeholders_as_retraced(plain,
                                                         make_pure(plain, forms, saved.names))
        try:
            pure = make_fx(functionalize(plain, remove="mutations"))(state, batch)
            half = same_nodes({n.name for n in plain.graph.nodes if n.meta.get(HALF_BIAS)},
                              plain, pure)
            for n in pure.graph.nodes:   # the retrace made new nodes, without the mark
                if n.name in half:
                    n.meta[HALF_BIAS] = True
            return pure, same_nodes(saved.names, plain, pure)
        except RuntimeError as exc:
            if "Functionalize" not in str(exc):
                raise
    return plain, saved.names


@contextlib.contextmanager
def _recording_in(step: Callable, grads: GradRecord) -> Iterator[Callable]:
    """``step``, run with ``grads`` recording its ops (the mode is entered inside make_fx's
    trace, above its proxy mode)."""
    def traced(state_list: list, batch_list: list) -> Any:   # make_fx names placeholders
        with grads.recording():                               # after these
            return step(state_list, batch_list)
    yield traced


def _mutates(gm: GraphModule) -> bool:
    """Whether a traced graph may write into a tensor: an aten op whose schema writes an
    argument (in-place, ``out=``), or a call fx cannot see into."""
    return bool(_writes(gm))


def _writes(gm: GraphModule) -> list[torch.fx.Node]:
    """The nodes of `_mutates`."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if isinstance(target, OpOverload):
                if target._schema.is_mutable:
                    out.append(node)
            elif target is not operator.getitem:
                out.append(node)
        elif node.op in ("call_method", "call_module"):
            out.append(node)
    return out


def _name_placeholders_as_retraced(gm: GraphModule, saved: set[str]) -> set[str]:
    """Name the placeholders as a retrace of ``gm(state, batch)`` would (``arg0_1``... the
    state, ``arg1_1``... the batch), so a program's node names, and with them its
    fingerprint, do not depend on whether it needed functionalizing; returns ``saved`` with
    the new names."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    counts = {"state": 0, "batch": 0}
    renames = {}
    for n in holders:
        which = "state" if n.name.startswith("state") else "batch"
        counts[which] += 1
        renames[n.name] = f"arg{0 if which == 'state' else 1}_{counts[which]}"
    for n in holders:
        n.name = f"_placeholder_{n.name}"   # free the new names first
    for n in holders:
        n.name = renames[n.name.removeprefix("_placeholder_")]
        n.target = n.name
    gm.recompile()
    return {renames.get(x, x) for x in saved}


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its ``_orig_mod``), else ``model`` itself:
    meshplan traces and runs the step's program on its own, and the wrapper would name every
    parameter ``_orig_mod.NAME`` and make dynamo trace the capture."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return model


def trace(model: nn.Module, loss_fn: Callable | None, example_batch: Any) -> Traced:
    """Trace one step's loss (``loss_fn(model(...), target)``, ``loss_fn(model(...))`` or the
    model's own loss when ``loss_fn`` is None; see ``capture/batch.py`` for the batch forms)
    at aten level without allocating memory.

    Raises TypeError for a malformed batch and ValueError if the loss is not a scalar tensor.
    """
    layout, batch = flatten_batch(example_batch)
    refuse_gradient_hooks(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    # Real tensors met during tracing (a plain tensor attribute, a torch.tensor(...) literal)
    # are constants of the program: fx keeps them as get_attr nodes.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # Parameters trace as tensors that require a gradient, so ops pick their differentiable
    # variants (embedding_bag, not _embedding_bag_forward_only).
    fake_state = {k: _as_fake(mode, v).requires_grad_(k in params and v.requires_grad)
                  for k, v in {**params, **buffers}.items()}
    fake_batch = [_as_fake(mode, t) for t in batch.values()]
    originals = [id(v) for v in {**params, **buffers}.values()]

    def step(state_list: list[torch.Tensor], batch_list: list[torch.Tensor]) -> torch.Tensor:
        args, kwargs, target = layout.call(batch_list)
        with stand_ins(model, dict(zip(originals, state_list))), static_routing(model):
            out = model(*args, **kwargs)
        return step_loss(loss_fn, out, target)

    # Lazy graph modules: the passes below (and make_fx itself) would each regenerate the
    # program's Python code, a second per pass at Llama-70B's 6,800 nodes; the code is made
    # once, when the program first runs.
    with _TRACE_LOCK, _as_a_tracer(), ModuleStack() as modules, lazy_graph_modules(True):
        try:
            gm, saved = _make_fx(step, mode, list(fake_state.values()), fake_batch)
        except (TypeError, ValueError):
            raise
        except Exception as exc:  # noqa: BLE001 - torch's own failures, re-explained
            raise explain_trace_failure(exc, model, modules) from exc
    drop_empty_cat_operands(gm)
    dense_embedding_gradients(gm)
    renames = fold_batched_matmuls(gm)
    loss = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    val = loss.meta.get("val") if isinstance(loss, torch.fx.Node) else None
    if val is None or tuple(val.shape) != ():
        raise ValueError("loss_fn must return a scalar tensor (e.g. a mean-reduced loss); got "
                         f"{None if val is None else tuple(val.shape)}")
    # A frozen parameter (requires_grad=False: a fine-tuned model's base, LoRA's) is state the
    # step reads and never updates: a buffer, held whole by every rank, without a gradient or
    # an optimizer's state.
    roles = ([("param" if v.requires_grad else "buffer", k) for k, v in params.items()]
             + [("buffer", k) for k in buffers]
             + [("target" if k in layout.target_names() else "input", k) for k in batch])
    renames = {**renames, **merge_common_subexpressions(gm)}
    return Traced(gm, tuple(roles), layout, renamed(saved, renames, gm))


@contextlib.contextmanager
def stand_ins(model: nn.Module, by_tensor: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within: every slot of ``model`` (a module's parameter or buffer, under any of its names)
    holding a tensor whose ``id`` is a key of ``by_tensor`` holds that tensor's stand-in;
    afterwards each slot holds its own tensor again, whatever happened. A module registered
    under two names and a parameter two modules share are each swapped once, by identity —
    ``torch.func.functional_call`` swaps by name and, for a module registered twice, restored
    its stand-ins instead of its parameters."""
    slots = []
    seen: set[int] = set()
    for _, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in by_tensor:
                    slots.append((table, attr, t))
    try:
        for table, attr, t in slots:
            table[attr] = by_tensor[id(t)]
        yield
    finally:
        for table, attr, t in slots:
            table[attr] = t


def dense_embedding_gradients(gm: GraphModule) -> None:
    """``nn.Embedding(sparse=True)`` and ``EmbeddingBag``'s: gradients computed dense. A plan
    accumulates, synchronizes, shards and clips gradients as dense tensors (a sparse one failed
    in the first accumulation); the values, and plain SGD's steps on them, are the same."""
    changed = False
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        names = [a.name for a in schema.arguments]
        if "sparse" not in names:
            continue
        at = names.index("sparse")
        if at < len(node.args) and node.args[at] is True:
            node.args = (*node.args[:at], False, *node.args[at + 1:])
            changed = True
        elif node.kwargs.get("sparse") is True:
            node.kwargs = {**node.kwargs, "sparse": False}
            changed = True
    if changed:
        gm.recompile()


def drop_empty_cat_operands(gm: GraphModule) -> None:
    """Remove ``torch.cat``'s empty operands: the legacy 1-D size-0 tensor torch.cat accepts
    next to tensors of any rank (a key/value cache that starts empty), or any operand with no
    elements. They add nothing; a cat left with one operand is that operand."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.cat.default:
            continue
        parts = list(node.args[0])
        kept = [p for p in parts if not _is_empty(p)]
        if len(kept) == len(parts) or not kept:
            continue
        dtypes = [k.meta["val"].dtype for k in kept]
        if functools.reduce(torch.promote_types, dtypes) != node.meta["val"].dtype:
            continue  # the empty operand sets the result's dtype: keep it
        changed = True
        if len(kept) == 1:
            with gm.graph.inserting_before(node):
                alone = gm.graph.call_function(aten.clone.default, (kept[0],))
            alone.meta.update(node.meta)
            node.replace_all_uses_with(alone)
            gm.graph.erase_node(node)
        else:
            node.args = (kept, *node.args[1:])
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _is_empty(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 0
