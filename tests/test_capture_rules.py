"""Signature rules as data: which dims each new rule lets split, and which it keeps whole."""

from __future__ import annotations

import pytest
import torch

from meshplan.capture.signature_rules import OpCall, rule_for
from meshplan.ir.signatures import signature_fits

aten = torch.ops.aten


def _call(overload, in_shapes, out_shape, args=(), kwargs=()) -> OpCall:
    packet = overload.__name__.split(".")[0]
    return OpCall(packet, tuple(in_shapes), out_shape, tuple(args), tuple(kwargs),
                  ("float32",) * len(in_shapes), overload)


@pytest.mark.parametrize("overload,n_in", [
    (aten.cos.default, 1), (aten.sin.default, 1), (aten.logical_not.default, 1),
    (aten.bitwise_and.Tensor, 2), (aten.clamp.default, 1), (aten.pow.Tensor_Scalar, 1),
    (aten.atan2.default, 2), (aten.hypot.default, 2), (aten.logical_or.default, 2),
])
def test_any_pointwise_op_is_elementwise_with_broadcasting(overload, n_in: int) -> None:
    shapes = [(4, 6), (1, 6)][:n_in]
    r = rule_for(_call(overload, shapes, (4, 6)))
    assert r is not None and r.sig.kind == "elementwise"
    assert signature_fits(r.sig, tuple(shapes), (4, 6))
    assert len(r.sig.splittable_atoms()) == 2   # both output dims; the broadcast 1 stays whole


def test_random_pointwise_ops_are_not_signed_as_elementwise() -> None:
    assert rule_for(_call(aten.rand_like.default, [(4, 6)], (4, 6))) is None


def test_gather_keeps_the_source_dim_whole_and_splits_the_rest_with_the_index() -> None:
    r = rule_for(_call(aten.gather.default, [(4, 6), (4, 2)], (4, 2), (None, 1, None)))
    (x0, x1), (i0, i1) = r.sig.inputs
    assert x0 == i0 and x0 in r.sig.splittable_atoms()     # rows split together
    assert x1 not in r.sig.splittable_atoms()              # gathered dim whole
    assert i1 in r.sig.splittable_atoms()                  # the index's own columns split


def test_index_select_never_splits_the_indexed_dim() -> None:
    r = rule_for(_call(aten.index_select.default, [(10, 6), (5,)], (5, 6), (None, 0, None)))
    (x0, x1), (i0,) = r.sig.inputs
    assert x0 not in r.sig.splittable_atoms() and i0 == r.sig.output[0]
    assert x1 == r.sig.output[1] and x1 in r.sig.splittable_atoms()


def test_topk_splits_other_dims_and_keeps_its_dim_whole() -> None:
    r = rule_for(_call(aten.topk.default, [(4, 8, 16)], (4, 8, 2), (None, 2, -1)))
    split = set(r.sig.splittable_atoms())
    assert r.sig.inputs[0][0] in split and r.sig.inputs[0][1] in split
    assert r.sig.inputs[0][2] not in split and r.sig.output[2] not in split


def test_var_mean_keeps_reduced_dims_whole() -> None:
    r = rule_for(_call(aten.var_mean.correction, [(4, 8)], (4,), (None, [1]),
                       (("correction", 1),)))
    assert r.sig.splittable_atoms() == (r.sig.inputs[0][0],)


def test_sdpa_mask_splits_with_batch_and_heads_it_belongs_to() -> None:
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = (2, 4, 8, 16)
    # Padding mask broadcast over heads and queries; ALiBi bias broadcast over the batch.
    for mask in ((2, 1, 1, 8), (1, 4, 8, 8)):
        r = rule_for(_call(op, [q, q, q, mask], q))
        b, h = r.sig.inputs[0][:2]
        m = r.sig.inputs[3]
        assert signature_fits(r.sig, (q, q, q, mask), q)
        assert (m[0] == b) == (mask[0] == 2) and (m[1] == h) == (mask[1] == 4)
        assert set(r.sig.splittable_atoms()) == {b, h}
