"""`make demo-pipeline` end to end: `auto` splits a GPT into stages for hosts of two GPUs (two
hosts, then four), and 4 and 8 real gloo processes train that plan with the losses of one
device."""

from __future__ import annotations

import functools

import pytest

import meshplan.demo_pipeline as demo

_PIPELINE_PLAN = demo.pipeline_plan


@functools.cache
def demo_plan(nproc: int) -> demo.api.Plan:
    """The demo's own plan (`pipeline_plan`), made once per session: `test_inter_methods`
    checks the 4-device one too."""
    return _PIPELINE_PLAN(nproc)


@pytest.mark.parametrize("nproc,steps", [(4, 2), (8, 1)])
def test_auto_pipeline_trains_like_one_device(nproc: int, steps: int,
                                              request: pytest.FixtureRequest,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 processes: the session's pool (`conftest.py`); 8 are spawned, as the demo does.
    pool = request.getfixturevalue("pool4") if nproc == 4 else None
    monkeypatch.setattr(demo, "pipeline_plan", demo_plan)
    plan, losses, ref = demo.run(nproc, steps, pool)
    assert plan.num_stages >= 2 and plan.method == "auto"
    assert sorted(d for s in plan.stages for d in s.devices) == list(range(nproc))
    assert losses == pytest.approx(ref, rel=1e-5)
