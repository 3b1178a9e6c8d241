"""A seeded sample of PyTorch's OpInfo database through capture, planning and emulated training
(the whole sweep is `make coverage`, results in docs/coverage.md): no crash, no wrong result, and
every op captured with signatures trains exactly like one device."""

from __future__ import annotations

import random
import warnings

from opinfo_sweep import float32_ops, run_op

SAMPLE = 64


def test_opinfo_sample_has_no_crash_and_every_signed_op_is_equal() -> None:
    ops = float32_ops()
    chosen = random.Random(2026).sample(ops, SAMPLE)
    bad = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in chosen:
            out = run_op(op)
            if out.outcome in ("crash", "differs") or (out.signed and out.outcome != "equal"):
                bad.append(out)
    assert not bad, "\n".join(f"{o.op}/{o.variant}: {o.outcome}: {o.reason}" for o in bad)
