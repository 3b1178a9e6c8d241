"""A seeded sample of PyTorch's operator database through capture, planning and emulated training
(`opinfo_sweep`; the whole database is `make coverage`, reported in docs/coverage.md).

Nothing is excluded from the sample: an op that crashes or trains differently fails the test,
named with its reason."""

from __future__ import annotations

import warnings

import pytest

import opinfo_sweep as sweep

SAMPLE = 64
SEED = 6
LIMIT_S = 30


@pytest.fixture(scope="module")
def outcomes() -> list[sweep.Outcome]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = sweep.sample_ops(sweep.float32_ops(), SAMPLE, SEED)
        return [sweep.run_op_limited(op, LIMIT_S) for op in ops]


def test_sample_is_large_and_mostly_runs(outcomes: list[sweep.Outcome]) -> None:
    assert len(outcomes) >= 60
    # Each sampled op must really reach meshplan; a sample of skips would prove nothing.
    assert sum(o.outcome != "skipped" for o in outcomes) >= 0.8 * len(outcomes), \
        [(sweep.label(o), o.reason) for o in outcomes if o.outcome == "skipped"]


def test_no_sampled_op_crashes_or_times_out(outcomes: list[sweep.Outcome]) -> None:
    bad = [f"{sweep.label(o)}: {o.outcome}: {o.reason}" for o in outcomes
           if o.outcome in ("crash", "timeout")]
    assert not bad, "\n".join(bad)


def test_every_sampled_op_trains_like_one_device(outcomes: list[sweep.Outcome]) -> None:
    # Signed or not (planned replicated), a plan that runs must equal the single device.
    wrong = [f"{sweep.label(o)} (signed={o.signed}): {o.reason}" for o in outcomes
             if o.outcome == "differs"]
    assert not wrong, "\n".join(wrong)


def test_every_signed_sampled_op_is_equal(outcomes: list[sweep.Outcome]) -> None:
    signed = [o for o in outcomes if o.signed]
    assert signed, "no sampled op was signed"
    assert all(o.outcome == "equal" for o in signed), \
        [(sweep.label(o), o.outcome, o.reason) for o in signed if o.outcome != "equal"]
