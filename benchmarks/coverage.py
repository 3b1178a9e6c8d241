"""The OpInfo sweep: every float32 op of PyTorch's operator database through capture, planning
and emulated training against one device (see tests/opinfo_sweep.py); writes docs/coverage.md.

Usage: python benchmarks/coverage.py [--out docs/coverage.md] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import platform
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

OUTCOMES = ("equal", "differs", "refused", "crash", "skipped")


def _run_slice(args: tuple[int, int]) -> list:
    warnings.simplefilter("ignore")
    from opinfo_sweep import float32_ops, run_op
    start, step = args
    return [run_op(op) for op in float32_ops()[start::step]]


def render(results: list, seconds: float, workers: int) -> str:
    counts = collections.Counter(r.outcome for r in results)
    signed = [r for r in results if r.signed]
    lines = [
        "# Operator coverage: PyTorch's OpInfo database",
        "",
        "Every op of `torch.testing._internal.common_methods_invocations.op_db` with float32 CPU "
        "support, its first sample input made a training problem: the sample's first float "
        "tensor is a parameter plus a batch input of its shape, the other tensors are buffers, "
        "the loss is the sum of the op's float outputs. Captured, planned on (1, 2) and (2, 2) "
        "(`auto` in α=β=1 units and `data`), trained 2 SGD steps on emulated ranks against the "
        "single device (losses and parameters at 1e-4, recorded == planned collectives). "
        "Harness: `tests/opinfo_sweep.py`.",
        "",
        f"Command: `make coverage` (`.venv/bin/python benchmarks/coverage.py --workers "
        f"{workers}`), {time.strftime('%Y-%m-%d')}, {platform.machine()}, Python "
        f"{platform.python_version()}, {seconds:.0f} s.",
        "",
        "| outcome | ops | meaning |",
        "|---|---|---|",
        f"| equal | {counts['equal']} | every plan trained exactly like one device |",
        f"| differs | {counts['differs']} | a plan trained differently (a wrong result) |",
        f"| refused | {counts['refused']} | meshplan declined with its own clear error |",
        f"| crash | {counts['crash']} | another exception (a bug) |",
        f"| skipped | {counts['skipped']} | no float sample, or it does not train on one device |",
        f"| **total** | {len(results)} | |",
        "",
        f"Captured with a dimension signature for every op of the program: {len(signed)}; of "
        f"those equal to one device: {sum(r.outcome == 'equal' for r in signed)}.",
        "",
        "| op | variant | outcome | signed | reason |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (OUTCOMES.index(r.outcome), r.op, r.variant)):
        reason = r.reason.replace("|", "\\|")
        lines.append(f"| {r.op} | {r.variant} | {r.outcome} | "
                     f"{'' if r.signed is None else 'yes' if r.signed else 'no'} | {reason} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "coverage.md"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        parts = pool.map(_run_slice, [(k, args.workers) for k in range(args.workers)])
    results = [r for part in parts for r in part]
    Path(args.out).write_text(render(results, time.perf_counter() - start, args.workers))
    counts = collections.Counter(r.outcome for r in results)
    print(dict(counts), f"-> {args.out}")


if __name__ == "__main__":
    main()
