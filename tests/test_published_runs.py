"""The simulator against published runs (issue 9): every row of `benchmarks/published_runs.py`
planned with its published configuration and simulated lands within the accepted distance of
the published TFLOP/s per GPU (Megatron-LM's rows ±17 %, Alpa's ±20 %), the calibration rows
on their figure, each planned within its device's memory and simulated to fit it, and
`docs/benchmarks.md` shows the table this code produces today.

Megatron-LM's rows were held to ±15 % until the simulator priced meshplan's own mixed
precision (session 54, from an H200's profile): autocast casts the fp32 layer norms' outputs
to half before each matmul, in every micro-batch, forward, replay and backward, on every
tensor-parallel rank, where Megatron-LM runs its whole model in fp16. That costs meshplan's
program of the 39.1B and 1T rows about 7 % (0.84 of published); ±17 % holds the simulator
to the rest."""

from __future__ import annotations

import re

import pytest

from bench_modules import ROOT, load

published_runs = load("published_runs")
CALIBRATION_ROWS = {"megatron-1.7b", "alpa-350m-1"}
TOLERANCE = {"megatron": 0.17, "alpa": 0.20}


def _documented_ratios() -> dict[str, float]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Simulator against published runs"):]
    ratios = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] in published_runs.ROWS:
            ratios[cells[0]] = float(cells[7])
    return ratios


@pytest.fixture(scope="module")
def documented() -> dict[str, float]:
    return _documented_ratios()


@pytest.mark.parametrize("row", list(published_runs.ROWS))
def test_row_is_within_the_accepted_distance(row: str, documented: dict[str, float]) -> None:
    r = published_runs.run_row(row)
    family = re.match(r"[a-z]+", row).group(0)
    assert abs(r["ratio"] - 1.0) <= TOLERANCE[family], r
    # Planned within the device's memory (the default budget), and the simulated run fits it.
    assert r["peak_gib"] <= r["device_gib"], r
    if row in CALIBRATION_ROWS:   # the device type's matmul efficiency was fitted on this row
        assert r["ratio"] == pytest.approx(1.0, abs=0.01)
    assert documented.get(row) == pytest.approx(r["ratio"], abs=0.005), \
        f"docs/benchmarks.md shows {documented.get(row)} for {row}; today's ratio {r['ratio']:.3f}"
