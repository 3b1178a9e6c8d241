"""Vocabulary-parallel embedding, softmax and cross-entropy (Megatron's pattern), tied weights."""

from __future__ import annotations

import pytest

from meshplan.runtime.emulated import run_emulated
from meshplan.zoo.spec import build_workload
from oracle import SGD, assert_matches, batches, make_plan, reference, shared_capture, train_rank

SPEC = "gpt:hidden=32,layers=1,heads=4,seq=16,vocab=512,batch=4"


@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 2)], ids=["1x2", "1x4", "2x2"])
def test_tied_vocab_split_language_model_matches_single_device(shape) -> None:
    plan = make_plan(SPEC, shape, "megatron", SGD, abstract=True)
    ops = {o.op: o for o in plan.ops}
    assert ops["embedding"].strategy.startswith("v:")      # masked lookup on vocab shards
    assert ops["log_softmax"].sync_axes == (1,)            # softmax over split vocabulary
    assert ops["nll_loss"].strategy.startswith("c:")       # targets picked on their shard
    assert plan.param("wte.weight").spec.startswith("S1")  # one tied table, split by rows
    assert not any(c.kind == "all_gather" and c.bytes >= 4 * 64 * 512 for c in plan.collectives)
    w = build_workload(SPEC, device="cpu", seed=0)
    data = batches(w, 3)
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, shape, plan, w, data, shared_capture(w)):
        assert_matches(r, ref, plan, SGD)
