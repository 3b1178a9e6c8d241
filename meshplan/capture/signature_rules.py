"""Per-op rules: aten op -> (normalized name, dimension signature, forward FLOPs).

One registry of plain functions keyed by aten overload packet name. Each rule sees the shapes
of the op's tensor operands and its output (from the fake tensors of the trace) and its non-tensor
arguments, and returns a `Signature` over those tensor operands in argument order. An op missing
here is planned replicated (see `meshplan.capture.to_ir`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Any

import torch

from meshplan.capture.routed_experts import routed_experts_rule
from meshplan.capture.rule_base import OpCall, OpRule, Rule, Shape, sized
from meshplan.capture.rules_select import SELECT_RULES
from meshplan.ir.graph import TensorInfo
from meshplan.ir.signatures import Dims, Signature, StatSync, fresh_atoms

# ---------------------------------------------------------------- contractions
def mm_rule(c: OpCall) -> OpRule:
    (i, k), (_, j) = c.in_shapes
    return OpRule("mm", sized(["ik", "kj"], "ij", c.in_shapes, c.out_shape, "contraction"),
                  2.0 * i * k * j)


def bmm_rule(c: OpCall) -> OpRule:
    (b, i, k), (_, _, j) = c.in_shapes
    sig = sized(["bik", "bkj"], "bij", c.in_shapes, c.out_shape, "contraction")
    return OpRule("bmm", sig, 2.0 * b * i * k * j)


def matmul_rule(c: OpCall) -> OpRule | None:
    """``matmul`` over equal batch dims (what `capture/fold_matmul` leaves): every batch dim an
    atom of its own, so batch and heads can be split over different mesh axes."""
    a, b = c.in_shapes
    if len(a) != len(b) or len(a) < 3 or a[:-2] != b[:-2]:
        return None
    lead = "".join(fresh_atoms(len(a) - 2, 700))
    sig = sized([lead + "ik", lead + "kj"], lead + "ij", c.in_shapes, c.out_shape,
                "contraction")
    return OpRule("matmul", sig, 2.0 * math.prod(c.out_shape) * a[-1])


def sdpa_rule(c: OpCall) -> OpRule:
    # All device variants of scaled-dot-product attention normalize to one op. Sequence and head
    # dims pass through a softmax, so only batch and heads can be split. A mask (boolean or
    # additive, attn_mask / attn_bias) broadcasts to (*lead, s, t): its dims split with the
    # batch and heads they belong to; a broadcast size-1 dim has its own atom and stays whole.
    q, k, v = c.in_shapes[:3]
    lead = "".join(fresh_atoms(len(q) - 2, 600))
    dims = [lead + "sd", lead + "te", lead + "tf"]
    pinned = {"s", "t", "d", "e", "f"}
    if len(c.in_shapes) > 3:
        full = c.out_shape[:-1] + (k[-2],)  # (*lead, s, t)
        mask = c.in_shapes[3]
        names = lead + "st"
        off = len(full) - len(mask)
        mdims = ""
        for pos, n in enumerate(mask):
            if n == full[off + pos]:
                mdims += names[off + pos]
            else:
                a = fresh_atoms(1, 650 + pos)[0]
                pinned.add(a)
                mdims += a
        dims.append(mdims)
    sig = sized(dims, lead + "sf", c.in_shapes, c.out_shape, "contraction", unsplittable=pinned)
    batch = math.prod(q[:-2])
    return OpRule("sdpa", sig, 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1]))


def embedding_rule(c: OpCall) -> OpRule:
    _, idx = c.in_shapes
    lead = "".join(fresh_atoms(len(idx), 700))
    # Splitting the vocabulary v is a masked lookup on each shard: partial sums (Megatron's
    # vocab-parallel embedding).
    sig = sized(["vh", lead], lead + "h", c.in_shapes, c.out_shape, "contraction")
    return OpRule("embedding", sig, 0.0)


# ---------------------------------------------------------------- elementwise family
def elementwise_rule(name: str) -> Rule:
    def rule(c: OpCall) -> OpRule:
        out = fresh_atoms(len(c.out_shape))
        dims: list[Dims] = []
        pinned: set[str] = set()
        for k, shape in enumerate(c.in_shapes):
            off = len(c.out_shape) - len(shape)
            d = []
            for pos, n in enumerate(shape):
                if n == c.out_shape[off + pos]:
                    d.append(out[off + pos])
                else:  # broadcast size-1 dim: its own atom, never split
                    a = fresh_atoms(1, 900 + 16 * k + pos)[0]
                    pinned.add(a)
                    d.append(a)
            dims.append(tuple(d))
        sig = sized(dims, out, c.in_shapes, c.out_shape, "elementwise", pinned)
        return OpRule(name, sig, float(math.prod(c.out_shape)))
    return rule


def normalize_last_rule(name: str, flops_per_elem: float, dim_arg: int | None) -> Rule:
    """Ops that normalize over some dims (softmax over `dim`, layer norm over the trailing ones)."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        if dim_arg is None:  # layer norm: normalized_shape = trailing dims
            nd = len(c.arg(1, "normalized_shape"))
            fixed = set(atoms[len(x) - nd:])
            extra = [atoms[len(x) - nd:]] * (len(c.in_shapes) - 1)
        else:
            dim = c.arg(dim_arg, "dim") % len(x)
            rows = tuple(a for i, a in enumerate(atoms) if i != dim)
            sig = sized([atoms], atoms, c.in_shapes, c.out_shape, "elementwise")
            # A split class dim exchanges per-row statistics: the rows' maxima (gathered,
            # detached: any shift is exact) and the sums of exponentials (all-reduced).
            sync = StatSync(frozenset({atoms[dim]}), rows,
                            4 * math.prod(n for i, n in enumerate(x) if i != dim),
                            (("all_gather", "none"), ("all_reduce", "all_reduce")))
            sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                            sig.atom_sizes, sync)
            return OpRule(name, sig, flops_per_elem * math.prod(x))
        out = atoms
        if tuple(c.out_shape) != tuple(x):  # the mean or rstd output: size 1 where normalized
            stat = fresh_atoms(nd, 450)
            out = (*atoms[:len(x) - nd], *stat)
            fixed |= set(stat)
        sig = sized([atoms, *extra], out, c.in_shapes, c.out_shape, "elementwise", fixed)
        return OpRule(name, sig, flops_per_elem * math.prod(x))
    return rule


# ---------------------------------------------------------------- reductions and losses
def reduction_rule(name: str, mean: bool) -> Rule:
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        dims = c.arg(1, "dim")
        dims = range(len(x)) if dims is None or dims == [] else [d % len(x) for d in dims]
        keep = bool(c.arg(2, "keepdim", False))
        red = {atoms[d] for d in dims}
        kept = fresh_atoms(len(x), 400)
        out = tuple((kept[i] if keep else None) if a in red else a for i, a in enumerate(atoms))
        out = tuple(a for a in out if a is not None)
        sig = sized([atoms], out, c.in_shapes, c.out_shape, "reduction",
                     unsplittable=set(kept), mean=red if mean else set())
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def nll_loss_rule(c: OpCall) -> OpRule:
    x = c.in_shapes[0]
    weighted = len(c.in_shapes) > 2
    reduction = c.arg(3, "reduction", 1)
    if len(x) != 2:
        raise ValueError("nll_loss is supported on (N, C) inputs")
    # A split class dim c picks each target on the shard that holds it: partial sums.
    # Reduction "none" (0) keeps one loss per row.
    sig = sized(["nc", "n"] + (["c"] if weighted else []), ("n",) if reduction == 0 else (),
                c.in_shapes, c.out_shape, "reduction", mean={"n"} if reduction == 1 else set())
    if reduction == 1:
        # The mean's divisor counts the targets not equal to ignore_index (weighted: sums
        # their class weights): one scalar per rank, all-reduced over the axes splitting the
        # batch (and, weighted, the classes: each rank weighs only its own classes' targets).
        # No gradient flows through a count.
        itemsize = TensorInfo((), c.in_dtypes[0]).nbytes if c.in_dtypes else 4
        sync = StatSync(frozenset("nc" if weighted else "n"), (), itemsize,
                        (("all_reduce", "none"),))
        sig = dataclasses.replace(sig, sync=sync)
    return OpRule("nll_loss", sig, float(x[0]))


def mse_loss_rule(c: OpCall) -> OpRule | None:
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    reduction = c.arg(2, "reduction", 1)
    if reduction == 0:   # "none": an elementwise squared difference
        return elementwise_rule("mse_loss")(c)
    sig = sized([atoms, atoms], (), c.in_shapes, c.out_shape, "reduction",
                 mean=set(atoms) if reduction == 1 else set())
    return OpRule("mse_loss", sig, 3.0 * math.prod(x))


# ---------------------------------------------------------------- views and data movement
def _view_dims(src: Shape, dst: Shape) -> tuple[list[str], list[str], set[str]]:
    """Factor a reshape into atoms: blocks of dims with equal products on both sides."""
    src_dims: list[str] = []
    dst_dims: list[str] = []
    pinned: set[str] = set()
    atoms = iter(fresh_atoms(2 * (len(src) + len(dst)) + 2))
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            a = next(atoms); pinned.add(a); src_dims.append(a); i += 1; continue
        if j < len(dst) and dst[j] == 1:
            a = next(atoms); pinned.add(a); dst_dims.append(a); j += 1; continue
        i0, j0, ps, pd = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                ps *= src[i]; i += 1
            else:
                pd *= dst[j]; j += 1
        if i - i0 == 1:  # one source dim split into several: atoms are the destination dims
            block = [next(atoms) for _ in range(j - j0)]
            src_dims.append("".join(block)); dst_dims.extend(block)
        elif j - j0 == 1:  # several source dims merged into one
            block = [next(atoms) for _ in range(i - i0)]
            dst_dims.append("".join(block)); src_dims.extend(block)
        else:  # many-to-many: factor both sides by their common refinement, if there is one
            block = _refine(src[i0:i], dst[j0:j], atoms)
            if block is None:  # e.g. (6, 4) -> (4, 6): nothing in it can stay split
                for _ in range(i - i0):
                    a = next(atoms); pinned.add(a); src_dims.append(a)
                for _ in range(j - j0):
                    a = next(atoms); pinned.add(a); dst_dims.append(a)
            else:
                for side, out in zip(block, (src_dims, dst_dims)):
                    for d in side:  # a size-1 dim inside the block: an atom of its own
                        if not d:
                            d = next(atoms); pinned.add(d)
                        out.append(d)
    return src_dims, dst_dims, pinned


def _refine(src: Shape, dst: Shape, atoms: Any) -> tuple[list[str], list[str]] | None:
    """Atoms at every boundary of either side's running product, e.g. (B, S) -> (G, k·S) with
    B = G·k gives atoms g, k, s; None when a boundary does not divide the next one."""
    bounds = sorted(set(itertools.accumulate(src, operator.mul))
                    | set(itertools.accumulate(dst, operator.mul)))
    prev, names = 1, {}
    for b in bounds:
        if b % prev:
            return None
        names[b] = next(atoms)
        prev = b

    def dims(shape: Shape) -> list[str]:
        out, start = [], 1
        for end in itertools.accumulate(shape, operator.mul):
            out.append("".join(names[b] for b in bounds if start < b <= end))
            start = end
        return out

    return dims(src), dims(dst)


def view_rule(c: OpCall) -> OpRule:
    src_dims, dst_dims, pinned = _view_dims(c.in_shapes[0], c.out_shape)
    sig = sized([src_dims], dst_dims, c.in_shapes, c.out_shape, "view", pinned)
    if sig.reduced_atoms - pinned:
        raise AssertionError(f"view factorization lost atoms: {c.in_shapes[0]} -> {c.out_shape}")
    return OpRule("view", _sized_view(sig, c), 0.0)


def _sized_view(sig: Signature, c: OpCall) -> Signature:
    # Atom sizes of merged dims come from the side where the atom is a whole dim.
    sizes = dict(sig.atom_sizes)
    sides = ((sig.inputs[0], c.in_shapes[0]), (sig.output, c.out_shape))
    known: set[str] = set()
    for dims, shape in sides:
        for d, n in zip(dims, shape):
            if len(d) == 1:
                sizes[d] = n
                known.add(d)
    # An atom only ever merged with others is sized by the dim where it is the one unknown.
    progress = True
    while progress:
        progress = False
        for dims, shape in sides:
            for d, n in zip(dims, shape):
                unknown = [a for a in d if a not in known]
                if len(unknown) == 1:
                    rest = math.prod(sizes[a] for a in d if a in known)
                    sizes[unknown[0]] = n // max(rest, 1)
                    known.add(unknown[0])
                    progress = True
    return Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                     tuple(sizes.items()))


def permute_rule(c: OpCall) -> OpRule:
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    if c.target == "t":
        order = list(reversed(range(len(x))))
    elif c.target == "transpose":
        order = list(range(len(x)))
        a, b = c.arg(1, "dim0") % len(x), c.arg(2, "dim1") % len(x)
        order[a], order[b] = order[b], order[a]
    else:
        order = [d % len(x) for d in c.arg(1, "dims")]
    sig = sized([atoms], [atoms[d] for d in order], c.in_shapes, c.out_shape, "view")
    return OpRule(c.target, sig, 0.0)


def expand_rule(c: OpCall) -> OpRule:
    x, out = c.in_shapes[0], c.out_shape
    out_atoms = fresh_atoms(len(out))
    off = len(out) - len(x)
    dims, pinned = [], set()
    for pos, n in enumerate(x):
        if n == out[off + pos]:
            dims.append(out_atoms[off + pos])
        else:
            a = fresh_atoms(1, 300 + pos)[0]; pinned.add(a); dims.append(a)
    sig = sized([dims], out_atoms, c.in_shapes, c.out_shape, "view", pinned)
    return OpRule("expand", sig, 0.0)


def dim_pinned_rule(name: str, dim_arg: int, dim_name: str) -> Rule:
    """Ops that keep shapes except along one dim, which must stay whole (cat, slice, split)."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = list(fresh_atoms(len(x)))
        d = c.arg(dim_arg, dim_name, 0) % len(x)
        fixed = set()
        ins = []
        for k in range(len(c.in_shapes)):
            a = list(atoms); a[d] = fresh_atoms(1, 500 + k)[0]; fixed.add(a[d]); ins.append(a)
        out = list(atoms); out[d] = fresh_atoms(1, 499)[0]; fixed.add(out[d])
        sig = sized(ins, out, c.in_shapes, c.out_shape, "view", fixed)
        return OpRule(name, sig, 0.0)
    return rule


# ---------------------------------------------------------------- convolutional nets
def conv_rule(c: OpCall) -> OpRule | None:
    """``convolution`` without bias (capture splits the bias off): batch, out-channel and
    in-channel (a contraction: partial sums) splits; spatial and kernel dims stay whole. With
    ``groups`` G > 1 the channels are (group, channel in group) and only whole groups split:
    input channels ``gc``, weight rows ``go``, output channels ``go`` with g leading (depthwise:
    c of size 1)."""
    if c.arg(6, "transposed") or len(c.in_shapes) != 2:
        return None
    x, w = c.in_shapes
    groups = c.arg(8, "groups", 1)
    sp = "".join(fresh_atoms(len(x) - 2, 20))
    ksp = "".join(fresh_atoms(len(x) - 2, 40))
    osp = "".join(fresh_atoms(len(x) - 2, 60))
    flops = 2.0 * math.prod(c.out_shape) * math.prod(w[1:])
    if groups == 1:
        sig = sized(["nc" + sp, "oc" + ksp], "no" + osp, c.in_shapes, c.out_shape,
                     "contraction", unsplittable=set(sp + ksp + osp))
        return OpRule("conv", sig, flops)
    sig = sized([["n", "gc", *sp], ["go", "c", *ksp]], ["n", "go", *osp], c.in_shapes,
                 c.out_shape, "contraction", unsplittable=set(sp + ksp + osp))
    sizes = {**dict(sig.atom_sizes), "g": groups, "c": w[1], "o": w[0] // groups}
    sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                    tuple(sizes.items()))
    return OpRule("conv", sig, flops)


def batch_norm_rule(c: OpCall) -> OpRule:
    """Training batch norm normalizes with statistics over batch and space: a split batch
    all-reduces them (`StatSync`); channels split freely, unless it updates running statistics:
    every rank holds those whole and updates them all, so it computes every channel. Eval mode
    is per-channel affine."""
    x = c.in_shapes[0]
    sp = "".join(fresh_atoms(len(x) - 2, 20))
    training = bool(c.arg(5, "training", True))
    whole = set(sp) | ({"c"} if training and c.arg(3, "running_mean") is not None else set())
    ins = ["nc" + sp] + ["c"] * (len(c.in_shapes) - 1)
    # Two all-reduces (mean, then squared deviations) of float64 per-channel sums, whatever
    # the input's dtype (`lower.local_ops.sync_batch_norm`).
    ar = ("all_reduce", "all_reduce")
    sync = StatSync(frozenset("n"), ("c",), x[1] * 8, (ar, ar), follows_input=False) \
        if training else None
    sig = sized(ins, "nc" + sp, c.in_shapes, c.out_shape, "elementwise", unsplittable=whole)
    sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                    sig.atom_sizes, sync)
    return OpRule("batch_norm", sig, 8.0 * math.prod(x))


def pool_rule(name: str) -> Rule:
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        sp = "".join(fresh_atoms(len(x) - 2, 20))
        osp = "".join(fresh_atoms(len(c.out_shape) - 2, 60))
        sig = sized(["nc" + sp], "nc" + osp, c.in_shapes, c.out_shape, "elementwise",
                     unsplittable=set(sp + osp))
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def along_dim_rule(name: str) -> Rule:
    """Ops that scan or select along one dim (cumsum; max/min over a dim): that dim is whole."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        if c.arg(1, "dim") is None:  # over everything: nothing can be split
            sig = sized([atoms], (), c.in_shapes, c.out_shape, "elementwise", set(atoms))
            return OpRule(name, sig, float(math.prod(x)))
        d = c.arg(1, "dim") % len(x)
        if len(c.out_shape) == len(x):
            out = list(atoms)
            if c.out_shape[d] != x[d]:
                out[d] = fresh_atoms(1, 400)[0]
        else:
            out = [a for i, a in enumerate(atoms) if i != d]
        sig = sized([atoms], out, c.in_shapes, c.out_shape, "elementwise",
                     unsplittable={atoms[d], *[a for a in out if a not in atoms]})
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def unbind_rule(c: OpCall) -> OpRule:
    """``unbind(x, dim)``: each piece is x without ``dim`` (whole); other dims split freely."""
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    d = c.arg(1, "dim", 0) % len(x)
    sig = sized([atoms], [a for i, a in enumerate(atoms) if i != d], c.in_shapes, c.out_shape,
                 "view", {atoms[d]})
    return OpRule("unbind", sig, 0.0)


def complex_view_rule(c: OpCall) -> OpRule:
    """``view_as_complex`` (x of shape (..., 2) -> (...)) and ``view_as_real`` (the reverse):
    the pair of real and imaginary parts stays whole, the other dims split freely (rotary
    embeddings done with complex numbers, as DeepSeek-V2's)."""
    x, out = c.in_shapes[0], c.out_shape
    atoms = fresh_atoms(max(len(x), len(out)))
    pair = atoms[-1]
    dims = (atoms, atoms[:-1]) if len(x) > len(out) else (atoms[:-1], atoms)
    sig = sized([dims[0]], dims[1], c.in_shapes, out, "view", {pair})
    return OpRule(c.target, sig, 0.0)


def random_rule(c: OpCall) -> OpRule:
    """Random draws (dropout's bernoulli mask) stay whole: every rank draws the global tensor
    from the same generator, as one device would, and keeps the piece it needs."""
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    sig = sized([atoms], atoms, c.in_shapes, c.out_shape, "random", set(atoms))
    return OpRule(c.target.rstrip("_"), sig, float(math.prod(x)))


# Elementwise ops that aten does not tag pointwise (every tagged op is signed by `rule_for`).
# ``fill`` (a scalar written into a view, as ``ids[..., 0] = start`` functionalizes) keeps its
# operand's shape and layout.
UNTAGGED_ELEMENTWISE = ("_to_copy", "alias", "detach", "native_dropout", "dropout",
                        "lift_fresh_copy", "clone", "fill")

RULES: dict[str, Rule] = {
    "mm": mm_rule, "bmm": bmm_rule, "matmul": matmul_rule, "embedding": embedding_rule,
    "_scaled_dot_product_flash_attention_for_cpu": sdpa_rule,
    "_scaled_dot_product_flash_attention": sdpa_rule,
    "_scaled_dot_product_efficient_attention": sdpa_rule,
    "_scaled_dot_product_attention_math": sdpa_rule,
    "_scaled_dot_product_cudnn_attention": sdpa_rule,
    "native_layer_norm": normalize_last_rule("layer_norm", 8.0, None),
    "_softmax": normalize_last_rule("softmax", 5.0, 1),
    # Softmax that gives 0 (not NaN) on fully masked rows: computed over the whole dim.
    "_safe_softmax": along_dim_rule("safe_softmax"),
    "_log_softmax": normalize_last_rule("log_softmax", 5.0, 1),
    "sum": reduction_rule("sum", mean=False), "mean": reduction_rule("mean", mean=True),
    "nll_loss_forward": nll_loss_rule, "mse_loss": mse_loss_rule,
    "view": view_rule, "_unsafe_view": view_rule, "reshape": view_rule,
    "unsqueeze": view_rule, "squeeze": view_rule, "flatten": view_rule,
    "t": permute_rule, "transpose": permute_rule, "permute": permute_rule,
    "expand": expand_rule,
    "convolution": conv_rule, "native_batch_norm": batch_norm_rule,
    "max_pool2d_with_indices": pool_rule("max_pool"), "avg_pool2d": pool_rule("avg_pool"),
    "_adaptive_avg_pool2d": pool_rule("adaptive_avg_pool"),
    "adaptive_avg_pool2d": pool_rule("adaptive_avg_pool"),
    "bernoulli_": random_rule, "bernoulli": random_rule,
    "cumsum": along_dim_rule("cumsum"), "max": along_dim_rule("max"),
    "min": along_dim_rule("min"),
    "cat": dim_pinned_rule("cat", 1, "dim"), "slice": dim_pinned_rule("slice", 1, "dim"),
    "split": dim_pinned_rule("split", 2, "dim"),
    "split_with_sizes": dim_pinned_rule("split", 2, "dim"),
    "unbind": unbind_rule,
    "view_as_complex": complex_view_rule, "view_as_real": complex_view_rule,
    # polar(abs, angle): elementwise, though aten does not tag it pointwise.
    "polar": elementwise_rule("polar"),
    "routed_experts": routed_experts_rule,
    # copy(dst, src): functionalized in-place copy_, src broadcast into dst's shape.
    "copy": elementwise_rule("copy"),
    **SELECT_RULES,
    **{n: elementwise_rule(n) for n in UNTAGGED_ELEMENTWISE},
}


# Ops that create tensors from nothing (or only from another tensor's shape and dtype): planned
# as replicated constants of the global shape.
CONSTANT_OPS = frozenset({"arange", "zeros", "ones", "full", "empty", "scalar_tensor", "tensor",
                          "empty_strided", "eye", "linspace", "logspace"})
LIKE_OPS = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "new_ones",
                      "new_zeros", "new_full", "new_empty", "new_empty_strided"})


def rule_for(c: OpCall) -> OpRule | None:
    """The signature of one op call: its rule in `RULES`, else, for any aten op tagged
    pointwise (and not random), the broadcasting elementwise rule; None when there is none."""
    rule = RULES.get(c.target)
    if rule is None and _is_pointwise(c.overload):
        rule = elementwise_rule(c.target.rstrip("_"))
    return rule(c) if rule is not None else None


def _is_pointwise(overload: Any) -> bool:
    tags = getattr(overload, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
