"""Time the planner's own ILPs: one Llama 3 70B block priced as a pipeline stage on the
submeshes and logical meshes of 8 DGX H100 hosts, as `meshplan plan hf:llama-3-70b,...`
prices it, under each ILP backend and formulation of the fan-out costs.

Usage: .venv/bin/python benchmarks/stage_ilps.py [--repeats 3] [--seq 4096]

Configurations (each a column, seconds summed over the problems, median of ``--repeats``):
``highs`` is the default (highspy, MIP restarts off, pair indicators for the shared costs);
``highs, restarts`` lets HiGHS restart; ``scipy`` is scipy.optimize.milp (its bundled HiGHS
cannot turn restarts off); ``clauses`` builds every shared cost as ``y >= [P] + [Q] - 1``.
Every problem is solved "free" (no memory bound) and "lean" (within 5 % of the least memory
any plan needs), as `StageProfiler` does; the objectives of all configurations must agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers, default_num_layers
from meshplan.planner.inter.stage_costs import StageProfiler
from meshplan.planner.intra import ilp_backends
from meshplan.planner.intra.choices import IntraOptions
from meshplan.planner.intra.ilp import IlpProblem, _memory_spec, min_memory, reduce_for_costs
from meshplan.planner.intra.ilp_model import build_model, extract_choices
from meshplan.planner.intra.ilp_problem import evaluate
from meshplan.zoo.spec import build_workload

CLUSTER = "dgx-h100:8"
BUDGET = 80 * 2**30
# (submesh, logical mesh): the shapes that cost the most when the search prices a block.
SHAPES = (((1, 4), (2, 2)), ((1, 8), (2, 4)), ((2, 8), (4, 4)), ((4, 8), (8, 4)),
          ((8, 8), (8, 8)), ((8, 8), (16, 4)))
# label -> (solver, shared-cost form, MIP restarts)
CONFIGS = {"highs": ("highs", "pairs", False), "highs, restarts": ("highs", "pairs", True),
           "highs, clauses": ("highs", "clauses", False), "scipy": ("scipy", "pairs", False),
           "scipy, clauses": ("scipy", "clauses", False)}


def stage_problems(seq: int) -> list[tuple[str, IlpProblem]]:
    """(label, problem) of a middle block on each of `SHAPES`, free and lean."""
    w = build_workload(f"hf:llama-3-70b,batch=1,seq={seq}", device="meta")
    graph = with_compute_dtype(capture(w.model, w.loss_fn, w.example_batch)[1], "bf16")
    layering = cluster_layers(graph, default_num_layers(graph, 64))
    prof = StageProfiler(graph, layering, parse_cluster_spec(CLUSTER),
                         IntraOptions(optimizer="adamw", memory_budget=BUDGET),
                         OptimizerState(), 512, BUDGET)
    middle = layering.num_layers // 2
    out = []
    for submesh, shape in SHAPES:
        problem = prof._form(middle, middle + 1, submesh, shape).problem
        out.append((f"{submesh} as {shape}, free", replace(problem, live_sets=())))
        lean = replace(problem, memory_budget=min_memory(problem) * 1.05)
        out.append((f"{submesh} as {shape}, lean", lean))
    return out


def solve_with(problem: IlpProblem, solver: str, form: str, restarts: bool) -> float:
    """The objective of ``problem`` solved by ``solver`` with shared costs in ``form``."""
    reduced = reduce_for_costs(problem)
    memory = _memory_spec(problem, problem.memory_budget) \
        if problem.live_sets and problem.memory_budget is not None else None
    model = build_model(reduced, memory=memory, shared_form=form)
    saved, ilp_backends._ALLOW_RESTART = ilp_backends._ALLOW_RESTART, restarts
    try:
        raw = ilp_backends.run_model(model, solver=solver, lp_first=None, time_limit_s=None)
    finally:
        ilp_backends._ALLOW_RESTART = saved
    return sum(evaluate(problem, extract_choices(reduced, model, raw.x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    problems = stage_problems(args.seq)
    print("| problem | " + " | ".join(CONFIGS) + " | objective |")
    print("|---|" + "---|" * (len(CONFIGS) + 1))
    totals = {label: 0.0 for label in CONFIGS}
    for name, problem in problems:
        cells, objectives = [], []
        for label, (solver, form, restarts) in CONFIGS.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                objective = solve_with(problem, solver, form, restarts)
                times.append(time.perf_counter() - start)
            totals[label] += statistics.median(times)
            cells.append(f"{statistics.median(times):.2f}")
            objectives.append(objective)
        agree = "agree" if np.allclose(objectives, objectives[0], rtol=1e-9) else "DIFFER"
        print(f"| {name} | " + " | ".join(cells) + f" | {objectives[0]:.6g} ({agree}) |",
              flush=True)
    print("| **all** | " + " | ".join(f"**{t:.2f}**" for t in totals.values()) + " | |")


if __name__ == "__main__":
    main()
