"""Per-op rules: aten op -> (normalized name, dimension signature, forward FLOPs).

One registry of plain functions keyed by aten overload packet name. Each rule sees the shapes
of the op's tensor operands and its output (from the fake tensors of the trace) and its non-tensor
arguments, and returns a `Signature` over those tensor operands in argument order. An op missing
here is planned replicated (see `meshplan.capture.to_ir`).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from meshplan.ir.signatures import Dims, Signature, StatSync, fresh_atoms

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpCall:
    """What a rule sees: operand shapes (tensor args in order), output shape, all args."""

    target: str
    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return dict(self.kwargs).get(name, default)


@dataclass(frozen=True)
class OpRule:
    name: str
    sig: Signature
    flops: float


Rule = Callable[[OpCall], "OpRule | None"]  # None: this variant of the op has no signature


def _sized(inputs: Sequence[Dims], output: Dims, shapes: Sequence[Shape], out_shape: Shape,
           kind: str, unsplittable: set[str] = frozenset(), mean: set[str] = frozenset()
           ) -> Signature:
    sizes: dict[str, int] = {}
    for dims, shape in zip((*inputs, output), (*shapes, out_shape)):
        for d, n in zip(dims, shape):
            if len(d) == 1:
                sizes.setdefault(d, n)
    for dims, shape in zip((*inputs, output), (*shapes, out_shape)):
        for d, n in zip(dims, shape):
            for a in d:
                sizes.setdefault(a, n)  # multi-atom dims: atoms sized by their own 1-atom dims
    return Signature(tuple(tuple(d) for d in inputs), tuple(output), kind,
                     frozenset(unsplittable), frozenset(mean), tuple(sizes.items()))


# ---------------------------------------------------------------- contractions
def mm_rule(c: OpCall) -> OpRule:
    (i, k), (_, j) = c.in_shapes
    return OpRule("mm", _sized(["ik", "kj"], "ij", c.in_shapes, c.out_shape, "contraction"),
                  2.0 * i * k * j)


def bmm_rule(c: OpCall) -> OpRule:
    (b, i, k), (_, _, j) = c.in_shapes
    sig = _sized(["bik", "bkj"], "bij", c.in_shapes, c.out_shape, "contraction")
    return OpRule("bmm", sig, 2.0 * b * i * k * j)


def sdpa_rule(c: OpCall) -> OpRule:
    # All device variants of scaled-dot-product attention normalize to one op. Sequence and head
    # dims pass through a softmax, so only batch and heads can be split. A mask (boolean or
    # additive, broadcast against (…, s, t)) is split with the batch and heads it belongs to.
    q, k, v = c.in_shapes[:3]
    lead = "".join(fresh_atoms(len(q) - 2, 600))
    dims: list = [lead + "sd", lead + "te", lead + "tf"]
    pinned = {"s", "t", "d", "e", "f"}
    for m, mask in enumerate(c.in_shapes[3:]):
        full = lead + "st"
        mine = []
        for i, n in enumerate(mask):
            atom = full[len(full) - len(mask) + i]
            if atom in "st" or n == (q[:-2] + (q[-2], k[-2]))[len(q) - len(mask) + i]:
                mine.append(atom)
            else:  # broadcast size-1 dim: its own atom, never split
                mine.append(fresh_atoms(1, 640 + 8 * m + i)[0])
                pinned.add(mine[-1])
        dims.append(tuple(mine))
    sig = _sized(dims, lead + "sf", c.in_shapes, c.out_shape, "contraction", unsplittable=pinned)
    batch = math.prod(q[:-2])
    return OpRule("sdpa", sig, 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1]))


def embedding_rule(c: OpCall) -> OpRule:
    _, idx = c.in_shapes
    lead = "".join(fresh_atoms(len(idx), 700))
    # Splitting the vocabulary v is a masked lookup on each shard: partial sums (Megatron's
    # vocab-parallel embedding).
    sig = _sized(["vh", lead], lead + "h", c.in_shapes, c.out_shape, "contraction")
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
        sig = _sized(dims, out, c.in_shapes, c.out_shape, "elementwise", pinned)
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
            sig = _sized([atoms], atoms, c.in_shapes, c.out_shape, "elementwise")
            # A split class dim exchanges per-row statistics: the rows' maxima (gathered,
            # detached: any shift is exact) and the sums of exponentials (all-reduced).
            sync = StatSync(frozenset({atoms[dim]}), rows,
                            4 * math.prod(n for i, n in enumerate(x) if i != dim),
                            (("all_gather", "none"), ("all_reduce", "all_reduce")))
            sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                            sig.atom_sizes, sync)
            return OpRule(name, sig, flops_per_elem * math.prod(x))
        sig = _sized([atoms, *extra], atoms, c.in_shapes, c.out_shape, "elementwise", fixed)
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
        sig = _sized([atoms], out, c.in_shapes, c.out_shape, "reduction",
                     unsplittable=set(kept), mean=red if mean else set())
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def nll_loss_rule(c: OpCall) -> OpRule:
    """NLL over (N, C) log-probabilities. A split class dim c picks each target on the shard
    that holds it: partial sums. A mean divides by the weight of the targets that are not
    ``ignore_index`` (padding labels), so a split batch all-reduces that one count
    (`StatSync`); class weights keep the class dim whole."""
    x = c.in_shapes[0]
    reduction = c.arg(3, "reduction", 1)
    if len(x) != 2 or reduction not in (1, 2):
        raise ValueError("nll_loss is supported on (N, C) inputs with reduction mean or sum; got "
                         f"input shape {tuple(x)}, reduction {reduction}")
    weighted = len(c.in_shapes) > 2
    sig = _sized(["nc", "n", "c"][:len(c.in_shapes)], (), c.in_shapes, c.out_shape, "reduction",
                 unsplittable={"c"} if weighted else set(),
                 mean={"n"} if reduction == 1 else set())
    if reduction == 1:
        sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                        sig.atom_sizes, StatSync(frozenset("n"), (), 8, (("all_reduce", "none"),)))
    return OpRule("nll_loss", sig, float(x[0]))


def mse_loss_rule(c: OpCall) -> OpRule:
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    reduction = c.arg(2, "reduction", 1)
    if reduction not in (1, 2):
        raise ValueError("mse_loss is supported with reduction mean or sum")
    sig = _sized([atoms, atoms], (), c.in_shapes, c.out_shape, "reduction",
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
                src_dims.extend(block[0]); dst_dims.extend(block[1])
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
    sig = _sized([src_dims], dst_dims, c.in_shapes, c.out_shape, "view", pinned)
    if sig.reduced_atoms - pinned:
        raise AssertionError(f"view factorization lost atoms: {c.in_shapes[0]} -> {c.out_shape}")
    return OpRule("view", _sized_view(sig, c), 0.0)


def _sized_view(sig: Signature, c: OpCall) -> Signature:
    # Atom sizes of merged dims come from the side where the atom is a whole dim.
    sizes = dict(sig.atom_sizes)
    for dims, shape in ((sig.inputs[0], c.in_shapes[0]), (sig.output, c.out_shape)):
        for d, n in zip(dims, shape):
            if len(d) == 1:
                sizes[d] = n
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
    sig = _sized([atoms], [atoms[d] for d in order], c.in_shapes, c.out_shape, "view")
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
    sig = _sized([dims], out_atoms, c.in_shapes, c.out_shape, "view", pinned)
    return OpRule("expand", sig, 0.0)


def dim_pinned_rule(name: str, dim_arg: int, dim_name: str) -> Rule:
    """Ops that keep shapes except along one dim, which must stay whole (cat, slice, split).
    ``torch.cat`` also accepts 1-D empty operands of any other rank: they get atoms of their own
    (a key/value cache that starts empty)."""
    def rule(c: OpCall) -> OpRule:
        x = c.out_shape if name == "cat" else c.in_shapes[0]
        atoms = list(fresh_atoms(len(x)))
        d = c.arg(dim_arg, dim_name, 0) % len(x)
        fixed = set()
        ins = []
        for k, shape in enumerate(c.in_shapes):
            if len(shape) != len(x):
                a = list(fresh_atoms(len(shape), 520 + 8 * k))
                fixed.update(a)
            else:
                a = list(atoms)
                a[d] = fresh_atoms(1, 500 + k)[0]
                fixed.add(a[d])
            ins.append(a)
        out = list(atoms); out[d] = fresh_atoms(1, 499)[0]; fixed.add(out[d])
        sig = _sized(ins, out, c.in_shapes, c.out_shape, "view", fixed)
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
        sig = _sized(["nc" + sp, "oc" + ksp], "no" + osp, c.in_shapes, c.out_shape,
                     "contraction", unsplittable=set(sp + ksp + osp))
        return OpRule("conv", sig, flops)
    sig = _sized([["n", "gc", *sp], ["go", "c", *ksp]], ["n", "go", *osp], c.in_shapes,
                 c.out_shape, "contraction", unsplittable=set(sp + ksp + osp))
    sizes = {**dict(sig.atom_sizes), "g": groups, "c": w[1], "o": w[0] // groups}
    sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                    tuple(sizes.items()))
    return OpRule("conv", sig, flops)


def batch_norm_rule(c: OpCall) -> OpRule:
    """Training batch norm normalizes with statistics over batch and space: a split batch
    all-reduces them (`StatSync`); channels split freely. Eval mode is per-channel affine."""
    x = c.in_shapes[0]
    sp = "".join(fresh_atoms(len(x) - 2, 20))
    training = bool(c.arg(5, "training", True))
    ins = ["nc" + sp] + ["c"] * (len(c.in_shapes) - 1)
    # Two all-reduces (mean, then squared deviations) of float64 per-channel sums.
    ar = ("all_reduce", "all_reduce")
    sync = StatSync(frozenset("n"), ("c",), x[1] * 8, (ar, ar)) if training else None
    sig = _sized(ins, "nc" + sp, c.in_shapes, c.out_shape, "elementwise", unsplittable=set(sp))
    sig = Signature(sig.inputs, sig.output, sig.kind, sig.unsplittable, sig.mean_atoms,
                    sig.atom_sizes, sync)
    return OpRule("batch_norm", sig, 8.0 * math.prod(x))


def pool_rule(name: str) -> Rule:
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        sp = "".join(fresh_atoms(len(x) - 2, 20))
        osp = "".join(fresh_atoms(len(c.out_shape) - 2, 60))
        sig = _sized(["nc" + sp], "nc" + osp, c.in_shapes, c.out_shape, "elementwise",
                     unsplittable=set(sp + osp))
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def along_dim_rule(name: str, dim_arg: int = 1, default: int | None = None) -> Rule:
    """Ops that scan or select along one dim (cumsum, sort, topk; max/min/argmax over a dim):
    that dim is whole, the others split freely. Without a dim (``max(x)``) nothing splits."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        d = c.arg(dim_arg, "dim", default)
        if d is None or not x:  # over everything: nothing can be split
            out = atoms if len(c.out_shape) == len(x) else fresh_atoms(len(c.out_shape), 400)
            sig = _sized([atoms], out, c.in_shapes, c.out_shape, "elementwise",
                         set(atoms) | set(out))
            return OpRule(name, sig, float(math.prod(x)))
        d = d % len(x)
        if len(c.out_shape) == len(x):
            out = list(atoms)
            if c.out_shape[d] != x[d]:
                out[d] = fresh_atoms(1, 400)[0]
        else:
            out = [a for i, a in enumerate(atoms) if i != d]
        sig = _sized([atoms], out, c.in_shapes, c.out_shape, "elementwise",
                     unsplittable={atoms[d], *[a for a in out if a not in atoms]})
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def pad_rule(c: OpCall) -> OpRule:
    """``constant_pad_nd``: padded (trailing) dims stay whole, the others split freely."""
    x = c.in_shapes[0]
    pad = list(c.arg(1, "pad"))
    padded = {len(x) - 1 - i // 2 for i, p in enumerate(pad) if p}
    atoms = fresh_atoms(len(x))
    out = [fresh_atoms(1, 400 + d)[0] if d in padded else a for d, a in enumerate(atoms)]
    pinned = {atoms[d] for d in padded} | {out[d] for d in padded}
    sig = _sized([atoms], out, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule("pad", sig, float(math.prod(c.out_shape)))


def gather_rule(c: OpCall) -> OpRule:
    """``gather(x, dim, index)``: the output has the index's shape; along ``dim`` x stays whole
    while index and output split together; other dims of equal size split all three alike."""
    x, idx = c.in_shapes[:2]
    d = c.arg(1, "dim") % len(x)
    out = list(fresh_atoms(len(idx)))
    xs, pinned = [], set()
    for i, n in enumerate(x):
        if i != d and n == idx[i]:
            xs.append(out[i])
        else:
            xs.append(fresh_atoms(1, 420 + i)[0])
            pinned.add(xs[-1])
    for i, n in enumerate(idx):
        if i != d and n != x[i]:
            pinned.add(out[i])
    sig = _sized([xs, out], out, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule("gather", sig, float(math.prod(c.out_shape)))


def scatter_rule(c: OpCall) -> OpRule:
    """``scatter(x, dim, index, src)`` / ``scatter_add``: the output is x's shape; along ``dim``
    everything stays whole; other dims where all operands agree split together."""
    x = c.in_shapes[0]
    d = c.arg(1, "dim") % len(x)
    atoms = list(fresh_atoms(len(x)))
    pinned = {atoms[d]}
    ins = [atoms]
    for k, shape in enumerate(c.in_shapes[1:]):
        mine = []
        for i, n in enumerate(shape):
            if i != d and n == x[i]:
                mine.append(atoms[i])
            else:
                mine.append(fresh_atoms(1, 440 + 8 * k + i)[0])
                pinned.add(mine[-1])
                if i != d:
                    pinned.add(atoms[i])
        ins.append(mine)
    sig = _sized(ins, atoms, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule(c.target.rstrip("_"), sig, float(math.prod(c.in_shapes[-1])))


def index_select_rule(c: OpCall) -> OpRule:
    """``index_select(x, dim, index)``: x whole along ``dim``; the output's dim follows the
    index, split with it; other dims split freely."""
    x = c.in_shapes[0]
    d = c.arg(1, "dim") % len(x)
    atoms = list(fresh_atoms(len(x)))
    pick = fresh_atoms(1, 460)[0]
    out = list(atoms)
    out[d] = pick
    sig = _sized([atoms, [pick]], out, c.in_shapes, c.out_shape, "elementwise", {atoms[d]})
    return OpRule("index_select", sig, float(math.prod(c.out_shape)))


def index_rule(c: OpCall) -> OpRule:
    """``x[i0, i1, ...]`` (``index.Tensor``): indexed dims of x stay whole and the index
    tensors' (broadcast) dims stay whole; the dims of x that are not indexed split freely."""
    x = c.in_shapes[0]
    indices = list(c.arg(1, "indices"))
    indexed = [d for d, i in enumerate(indices) if i is not None]
    atoms = list(fresh_atoms(len(x)))
    idx_nd = len(c.out_shape) - (len(x) - len(indexed))
    idx_atoms = list(fresh_atoms(idx_nd, 480))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    rest = [a for d, a in enumerate(atoms) if d not in indexed]
    if adjacent:
        before = [a for d, a in enumerate(atoms) if d < indexed[0]]
        out = before + idx_atoms + rest[len(before):]
    else:
        out = idx_atoms + rest
    ins = [atoms]
    for k, shape in enumerate(c.in_shapes[1:]):
        ins.append(idx_atoms[idx_nd - len(shape):] if all(
            n == c.out_shape[out.index(a)] for n, a in zip(shape, idx_atoms[idx_nd - len(shape):]))
            else list(fresh_atoms(len(shape), 500 + 8 * k)))
    pinned = {atoms[d] for d in indexed} | set(idx_atoms) | {a for i in ins[1:] for a in i}
    sig = _sized(ins, out, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule("index", sig, float(math.prod(c.out_shape)))


def stat_reduction_rule(name: str) -> Rule:
    """Variance-like reductions (``var``, ``std``, ``var_mean``): the reduced dims stay whole
    (a split one would need its moments combined), kept dims split freely."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        dims = c.arg(1, "dim")
        dims = range(len(x)) if dims is None or dims == [] else [d % len(x) for d in dims]
        keep = len(c.out_shape) == len(x)
        red = {atoms[d] for d in dims}
        kept = fresh_atoms(len(x), 400)
        out = [(kept[i] if keep else None) if a in red else a for i, a in enumerate(atoms)]
        out = [a for a in out if a is not None]
        sig = _sized([atoms], out, c.in_shapes, c.out_shape, "elementwise",
                     unsplittable=red | set(kept))
        return OpRule(name, sig, 2.0 * math.prod(x))
    return rule


def random_rule(c: OpCall) -> OpRule:
    """Random draws (dropout's bernoulli mask) stay whole: every rank draws the global tensor
    from the same generator, as one device would, and keeps the piece it needs."""
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    sig = _sized([atoms], atoms, c.in_shapes, c.out_shape, "random", set(atoms))
    return OpRule(c.target.rstrip("_"), sig, float(math.prod(x)))


UNARY = ("relu", "gelu", "tanh", "silu", "sigmoid", "neg", "exp", "log", "rsqrt", "sqrt", "abs",
         "pow", "clone", "_to_copy", "alias", "detach", "threshold", "native_dropout", "dropout",
         "lift_fresh_copy", "square", "erf", "reciprocal")
BINARY = ("add", "sub", "mul", "div", "where", "maximum", "minimum", "eq", "ne", "lt", "gt",
          "le", "ge", "masked_fill", "rsub")

RULES: dict[str, Rule] = {
    "mm": mm_rule, "bmm": bmm_rule, "embedding": embedding_rule,
    "_scaled_dot_product_flash_attention_for_cpu": sdpa_rule,
    "_scaled_dot_product_flash_attention": sdpa_rule,
    "_scaled_dot_product_efficient_attention": sdpa_rule,
    "_scaled_dot_product_attention_math": sdpa_rule,
    "_scaled_dot_product_cudnn_attention": sdpa_rule,
    "native_layer_norm": normalize_last_rule("layer_norm", 8.0, None),
    "_softmax": normalize_last_rule("softmax", 5.0, 1),
    # A softmax that gives zeros for fully masked rows: its dim is never split (no statistics
    # exchange for it), every other dim is.
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
    "min": along_dim_rule("min"), "topk": along_dim_rule("topk", 2, -1), "sort": along_dim_rule("sort", 1, -1),
    "argmax": along_dim_rule("argmax"), "argmin": along_dim_rule("argmin"),
    "cumprod": along_dim_rule("cumprod"), "logsumexp": stat_reduction_rule("logsumexp"),
    "constant_pad_nd": pad_rule, "gather": gather_rule, "scatter": scatter_rule,
    "scatter_add": scatter_rule, "index_select": index_select_rule, "index": index_rule,
    "var": stat_reduction_rule("var"), "std": stat_reduction_rule("std"),
    "var_mean": stat_reduction_rule("var_mean"), "std_mean": stat_reduction_rule("std_mean"),
    "cat": dim_pinned_rule("cat", 1, "dim"), "slice": dim_pinned_rule("slice", 1, "dim"),
    "split": dim_pinned_rule("split", 2, "dim"),
    "split_with_sizes": dim_pinned_rule("split", 2, "dim"),
    **{n: elementwise_rule(n) for n in UNARY + BINARY},
}

# In-place variants (``div_``) follow their functional op's rule.
RULES.update({f"{name}_": rule for name, rule in list(RULES.items())
              if name in UNARY + BINARY and f"{name}_" not in RULES})

# Ops that create tensors from nothing (or only from another tensor's shape): planned as
# replicated constants of the global shape.
CONSTANT_OPS = frozenset({"arange", "zeros", "ones", "full", "empty", "scalar_tensor", "tensor",
                          "eye", "linspace", "empty_strided"})
# Ops whose tensor operand gives only a dtype (``x.new_ones(size)``) or a shape (``ones_like``):
# constants of the *global* shape, whatever piece of the operand a rank holds.
LIKE_OPS = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "new_ones",
                      "new_zeros", "new_full", "new_empty", "new_empty_strided"})


def is_pointwise(target: Any) -> bool:
    """An aten overload tagged pointwise (elementwise with broadcasting) and not random."""
    import torch
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def is_random(target: Any) -> bool:
    import torch
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
