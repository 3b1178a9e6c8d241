"""Fit each device type's matmul efficiency at fp16 on one published run, once per device type.

For every device type with published rows (`published_runs.ROWS`), one *calibration row* — the
run with the least communication, so that its time is mostly the device's own compute — fixes
the fraction of fp16 peak that large matmuls reach: the efficiency at which the simulated TFLOP/s
per GPU of that row equals the published figure (bisection; each probe plans and simulates the
row). Every other row of the device type is then a prediction, not a fit. Memory-bound and link
efficiencies are not fitted here (too few rows to tell them apart); their values and sources are
in `docs/calibration.md`.

The fitted values are written by hand into `meshplan/cost/devices.py` (rounded to 0.01); this
script is how they were found and how to find them again after the cost model changes.

Usage: python benchmarks/calibrate_devices.py [--tolerance 0.002]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from published_runs import ROWS, run_row

# device type: its calibration row (the one whose time communication least blurs)
CALIBRATION_ROWS = {
    "A100-SXM4-80GB": "megatron-1.7b",  # data parallel only: one gradient all-reduce per step
    "V100-SXM2-16GB": "alpa-350m-1",  # one GPU: no communication at all
}


def _with_efficiency(device: object, value: float) -> object:
    effs = dict(device.efficiency)
    effs["float16"] = value
    return dataclasses.replace(device, efficiency=effs)


def fit(device_name: str, row: str, tolerance: float) -> tuple[float, dict]:
    """The fp16 matmul efficiency at which ``row`` simulates at its published TFLOP/s."""
    from meshplan.cost.devices import device_type
    base = device_type(device_name)
    lo, hi = 0.2, 1.0
    best = None
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        best = run_row(row, _with_efficiency(base, mid))
        print(f"  {row}: efficiency {mid:.4f} -> ratio {best['ratio']:.4f}", flush=True)
        if best["ratio"] < 1.0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=0.002,
                    help="width of the final bisection interval (default 0.002)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    for device, row in CALIBRATION_ROWS.items():
        if row not in ROWS:
            raise SystemExit(f"calibration row {row!r} is not in published_runs.ROWS")
        value, _ = fit(device, row, args.tolerance)
        print(f"{device}: fp16 matmul efficiency {value:.3f} (from {row})", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
