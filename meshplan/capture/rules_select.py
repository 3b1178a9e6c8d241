"""Signature rules of ops that select, scatter or reduce along one dim that must stay whole.

``gather``/``index``/``index_select`` read anywhere along the indexed dim of their source, and
``scatter`` writes anywhere along it, so that dim is never split; every other dim is split only
where the source, the index (and the scattered values) have the same extent, so each rank's
pieces line up. ``topk``/``sort``/``argmax``/``var``… compute along a dim over all of it: that dim
is whole and the others split freely. Each rule returns a signature whose splits all give the
single-device result when the traced op runs on the local pieces.
"""

from __future__ import annotations

import math

from meshplan.capture.rule_base import OpCall, OpRule, Rule, sized
from meshplan.ir.signatures import fresh_atoms


def _pinned(k: int) -> str:
    return fresh_atoms(1, 1200 + k)[0]


def gather_rule(c: OpCall) -> OpRule | None:
    """``gather(x, dim, index)``: out[i] = x[..., index[i], ...]; index and out split anywhere,
    x's ``dim`` whole, x's other dims split with the index where the extents agree."""
    x, idx = c.in_shapes
    if len(x) != len(idx) or not x:
        return None
    d = c.arg(1, "dim") % len(x)
    out = fresh_atoms(len(idx))
    xd, pinned = [], set()
    for i, n in enumerate(x):
        a = out[i] if i != d and n == idx[i] else _pinned(i)
        if a != out[i]:
            pinned.add(a)
        xd.append(a)
    sig = sized([xd, out], out, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule("gather", sig, float(math.prod(c.out_shape)))


def scatter_rule(c: OpCall) -> OpRule | None:
    """``scatter``/``scatter_add``/``scatter_reduce`` (x, dim, index[, src]): writes anywhere
    along ``dim``, so it is whole everywhere; another dim splits only where x, index and src
    have the same extent (each rank scatters its own rows)."""
    shapes = c.in_shapes
    x = shapes[0]
    if any(len(s) != len(x) for s in shapes) or not x:
        return None
    d = c.arg(1, "dim") % len(x)
    dims: list[list[str]] = [[] for _ in shapes]
    pinned = set()
    for i in range(len(x)):
        shared = i != d and all(s[i] == x[i] for s in shapes)
        for k in range(len(shapes)):
            a = fresh_atoms(1, i)[0] if shared else _pinned(16 * k + i)
            if not shared:
                pinned.add(a)
            dims[k].append(a)
    sig = sized(dims, dims[0], shapes, c.out_shape, "elementwise", pinned)
    return OpRule(c.target, sig, float(math.prod(shapes[1])))


def index_rule(c: OpCall) -> OpRule | None:
    """``x[..., idx1, :, idx2, ...]`` (``aten.index.Tensor``): the indexed dims of x are whole;
    the index tensors broadcast to one shape whose dims (split freely, with every index tensor
    of that extent there) replace them in the output: in place when the indexed dims are
    consecutive, else first, as torch orders them. x's other dims split freely."""
    indices = c.arg(1, "indices")
    x = c.in_shapes[0]
    where = [i for i, t in enumerate(indices) if t is not None]
    idx_shapes = c.in_shapes[1:]
    if not where or len(idx_shapes) != len(where):
        return None
    rank = max(len(s) for s in idx_shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in idx_shapes]
    common = tuple(max(col) for col in zip(*padded))
    if any(n not in (1, m) for s in padded for n, m in zip(s, common)):
        return None
    mid = fresh_atoms(rank, 200)
    idx_dims = [[mid[rank - len(s) + i] if n == common[rank - len(s) + i] else _pinned(50 + i)
                 for i, n in enumerate(s)] for s in idx_shapes]
    free = {i: a for i, a in zip(range(len(x)), fresh_atoms(len(x)))}
    whole = {i: _pinned(300 + i) for i in where}
    xdims = [whole.get(i, free[i]) for i in range(len(x))]
    rest = [free[i] for i in range(len(x)) if i not in whole]
    if where == list(range(where[0], where[0] + len(where))):
        out = (*rest[:where[0]], *mid, *rest[where[0]:])
    else:
        out = (*mid, *rest)
    if len(out) != len(c.out_shape):
        return None
    pinned = set(whole.values()) | {a for d in idx_dims for a in d if a not in mid}
    sig = sized([xdims, *idx_dims], out, c.in_shapes, c.out_shape, "elementwise", pinned)
    return OpRule("index", sig, float(math.prod(c.out_shape)))


def repeat_rule(c: OpCall) -> OpRule | None:
    """``repeat(x, sizes)``: a dim repeated more than once is whole (its copies are laid end to
    end), as are the new leading dims; a dim repeated once splits freely."""
    x, sizes = c.in_shapes[0], list(c.arg(1, "repeats", ()))
    if len(sizes) < len(x):
        return None
    lead = len(sizes) - len(x)
    atoms = list(fresh_atoms(len(x)))
    out = [_pinned(i) for i in range(lead)] + list(atoms)
    for d in range(len(x)):
        if sizes[lead + d] != 1:
            atoms[d], out[lead + d] = _pinned(100 + 2 * d), _pinned(101 + 2 * d)
    sig = sized([atoms], out, c.in_shapes[:1], c.out_shape, "elementwise",
                 {a for a in (*atoms, *out) if a not in fresh_atoms(len(x))})
    return OpRule("repeat", sig, float(math.prod(c.out_shape)))


def pad_rule(c: OpCall) -> OpRule | None:
    """``constant_pad_nd`` / ``reflection_pad*`` / ``replication_pad*`` (x, pad): ``pad``
    gives (before, after) pairs from the last dim backwards; a padded dim is whole (its
    extent changes and its border reads across it), every other dim splits freely."""
    x = c.in_shapes[0]
    pad = list(c.arg(1, "pad", ()))
    if len(pad) % 2 or len(pad) // 2 > len(x):
        return None
    padded = {len(x) - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
    atoms = list(fresh_atoms(len(x)))
    out = list(atoms)
    for d in padded:
        atoms[d], out[d] = _pinned(2 * d), _pinned(2 * d + 1)
    sig = sized([atoms], out, c.in_shapes[:1], c.out_shape, "elementwise",
                 {a for d in padded for a in (atoms[d], out[d])})
    return OpRule(c.target, sig, float(math.prod(c.out_shape)))


def index_put_rule(c: OpCall) -> OpRule | None:
    """``x[..., idx] = v`` (``index_put``, what functionalization makes of it): the indexed dims
    of x and the index tensors' dims stay whole (every rank writes every indexed row); x's
    other dims split with the values' matching dims (a broadcast values dim stays whole)."""
    indices = c.arg(1, "indices")
    x = c.in_shapes[0]
    where = [i for i, t in enumerate(indices) if t is not None]
    if not where or where != list(range(where[0], where[0] + len(where))):
        return None
    idx_shapes, values = c.in_shapes[1:-1], c.in_shapes[-1]
    if any(s != idx_shapes[0] for s in idx_shapes):
        return None
    p, k = where[0], len(where)
    lead, tail = fresh_atoms(p), fresh_atoms(len(x) - p - k, 100)
    whole, mid = fresh_atoms(k, 300), fresh_atoms(len(idx_shapes[0]), 200)
    full = (*lead, *mid, *tail)
    full_shape = (*x[:p], *idx_shapes[0], *x[p + k:])
    off = len(full) - len(values)
    if off < 0:
        return None
    vdims = [full[off + i] if n == full_shape[off + i] else _pinned(i)
             for i, n in enumerate(values)]
    pinned = {*whole, *mid, *[a for a in vdims if a not in full]}
    xdims = (*lead, *whole, *tail)
    sig = sized([xdims, *[mid] * len(idx_shapes), vdims], xdims, c.in_shapes, c.out_shape,
                 "elementwise", pinned)
    return OpRule("index_put", sig, float(math.prod(values)))


def index_select_rule(c: OpCall) -> OpRule:
    """``index_select(x, dim, index)``: x's ``dim`` whole, the index split with the output."""
    x = c.in_shapes[0]
    d = c.arg(1, "dim") % len(x)
    out = list(fresh_atoms(len(x)))
    xd = list(out)
    xd[d] = _pinned(0)
    sig = sized([xd, (out[d],)], out, c.in_shapes, c.out_shape, "elementwise", {xd[d]})
    return OpRule("index_select", sig, float(math.prod(c.out_shape)))


def along_whole_dim_rule(name: str, dim_arg: int | None) -> Rule:
    """Ops computing along one dim over all of it (topk, sort, argsort; tril/triu use the last
    two): that dim is whole in operand and outputs, every other dim split freely."""
    def rule(c: OpCall) -> OpRule:
        x = c.in_shapes[0]
        atoms = list(fresh_atoms(len(x)))
        out = list(atoms)
        if dim_arg is None:  # the last two dims (a matrix op on a batch of matrices)
            whole = range(max(len(x) - 2, 0), len(x))
        else:
            whole = [c.arg(dim_arg, "dim", -1) % max(len(x), 1)] if x else []
        pinned = set()
        for k, d in enumerate(whole):
            atoms[d], out[d] = _pinned(2 * k), _pinned(2 * k + 1)
            pinned |= {atoms[d], out[d]}
        sig = sized([atoms], out, c.in_shapes, c.out_shape, "elementwise", pinned)
        return OpRule(name, sig, float(math.prod(x)))
    return rule


def whole_reduction_rule(name: str) -> Rule:
    """Reductions that are not sums (var, std, var_mean, amax, argmax, prod, any, logsumexp…):
    a split reduced dim would need more than a partial sum, so reduced dims are whole; kept dims
    split freely. ``keepdim`` is read from the output's rank (overloads place it differently)."""
    def rule(c: OpCall) -> OpRule | None:
        x = c.in_shapes[0]
        atoms = fresh_atoms(len(x))
        dims = c.arg(1, "dim")
        if isinstance(dims, int):
            dims = [dims]
        dims = range(len(x)) if not dims else [d % len(x) for d in dims]
        keep = len(c.out_shape) == len(x) and len(x) > 0
        red = {atoms[d] for d in dims}
        out = [(_pinned(i) if keep else None) if a in red else a for i, a in enumerate(atoms)]
        out = [a for a in out if a is not None]
        sig = sized([atoms], out, c.in_shapes, c.out_shape, "reduction",
                     red | {a for a in out if a not in atoms})
        return OpRule(name, sig, 2.0 * math.prod(x))
    return rule


def select_rule(c: OpCall) -> OpRule:
    """``select(x, dim, i)`` (``x[:, i]``): x's ``dim`` whole, the others split freely."""
    x = c.in_shapes[0]
    atoms = fresh_atoms(len(x))
    d = c.arg(1, "dim") % len(x)
    sig = sized([atoms], [a for i, a in enumerate(atoms) if i != d], c.in_shapes, c.out_shape,
                 "view", {atoms[d]})
    return OpRule("select", sig, 0.0)


def scatter_into_rule(c: OpCall) -> OpRule | None:
    """``slice_scatter``/``select_scatter`` (x, src, dim, …): what functionalization makes of
    an in-place write into a view (``x[:, 0] += …``). ``dim`` is whole in x, src and the
    output; every other dim splits with src, which has the same extent there."""
    x, src = c.in_shapes
    d = c.arg(2, "dim", 0) % len(x)
    atoms = list(fresh_atoms(len(x)))
    atoms[d] = _pinned(0)
    if c.target == "select_scatter":
        src_dims = [a for i, a in enumerate(atoms) if i != d]
    else:
        src_dims = list(atoms)
        src_dims[d] = _pinned(1)
    if [n for i, n in enumerate(x) if i != d] != [n for i, n in enumerate(src)
                                                  if c.target == "select_scatter" or i != d]:
        return None
    sig = sized([atoms, src_dims], atoms, c.in_shapes, c.out_shape, "elementwise",
                 {_pinned(0), _pinned(1)})
    return OpRule(c.target, sig, float(math.prod(src)))


SELECT_RULES: dict[str, Rule] = {
    "select": select_rule, "slice_scatter": scatter_into_rule,
    "select_scatter": scatter_into_rule,
    "gather": gather_rule, "index": index_rule, "index_select": index_select_rule,
    "index_put": index_put_rule, "repeat": repeat_rule,
    **{n: pad_rule for n in ("constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
                             "reflection_pad3d", "replication_pad1d", "replication_pad2d",
                             "replication_pad3d")},
    "scatter": scatter_rule, "scatter_add": scatter_rule, "scatter_reduce": scatter_rule,
    "topk": along_whole_dim_rule("topk", 2), "sort": along_whole_dim_rule("sort", 1),
    "argsort": along_whole_dim_rule("argsort", 1),
    "tril": along_whole_dim_rule("tril", None), "triu": along_whole_dim_rule("triu", None),
    **{n: whole_reduction_rule(n) for n in (
        "var", "std", "var_mean", "std_mean", "amax", "amin", "argmax", "argmin", "prod", "any",
        "all", "logsumexp", "linalg_vector_norm")},
}
