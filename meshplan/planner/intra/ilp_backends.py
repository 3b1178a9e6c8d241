"""Run a ``MilpModel`` on HiGHS, either through ``highspy`` directly or ``scipy.optimize.milp``.

Both are asked for a proven optimum: relative and absolute MIP gaps 0 on ``highspy``; scipy
exposes only the relative gap and keeps HiGHS's absolute gap of 1e-6. Costs are first scaled to
a largest coefficient of 1e6 (``_normalize_costs``): HiGHS's absolute tolerances (1e-7 on
reduced costs, 1e-6 gap) otherwise treat costs in seconds (~1e-9..1e-5 each) as ties and stop
far from the optimum (measured: 1.4x-2.4x the optimum on memory-bound DAGs in units of 1e-9).
``lp_first`` solves the LP relaxation first and stops when its optimum is already integral
(an integral LP optimum is a MIP optimum). Measured (``benchmarks/ilp_solvers.py``): that saves
~35 % when only one-hot and marginal rows exist, and costs 10-40 % when memory rows bind (the
LP is then fractional), so ``lp_first=None`` decides by whether coupling rows exist.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from meshplan.errors import IlpCutOffError, InfeasibleIlpError, NodeLimitError
from meshplan.planner.intra.ilp_model import MilpModel

SOLVERS = ("highs", "scipy")

# A binary counts as integral when within this distance of 0 or 1 (HiGHS's own MIP tolerance).
_INTEGRALITY_TOL = 1e-6
# HiGHS restarts its MIP search after presolving again once many binaries are fixed at the
# root. On the planner's stage problems (a layer on a 2-D mesh: ~300 binaries, a weak LP
# bound) the restarts take half the time and prove the same optimum: 14 problems of a
# Llama 3 70B layer solve in 6.9 s without them, 13.4 s with (scipy, HiGHS 1.12: 13.0 s).
_ALLOW_RESTART = False
# Branching by pseudo-costs from the first node, without strong branching to make them
# reliable first: a whole pipeline stage under its memory bound (Llama 3 70B's first 9
# layers on a 2x4 mesh, 1,200 binaries) spent most of its 39 s in strong branching; 21 s
# without it, the same optimum, and the one-layer problems unchanged (3.8 s -> 3.7 s for 14).
_PSCOST_MIN_RELIABLE = 0
# HiGHS's feasibility jump (a root heuristic that looks for a first feasible point) off: on
# the planner's problems the root's LP rounding and sub-MIPs find as good a point, and the
# jump only spent time. Sampled solves of three planning runs, each solved as the planner
# solves it, best of two (one worker): Wide-ResNet-2B reduced, 95 problems 3.04 -> 2.58 s,
# every answer the same; MoE-2.4B reduced, 32 problems 7.52 -> 6.80 s, one answer different
# by rounding; GPT-39B on 64 V100, 107 problems 17.4 -> 16.5 s, 7 different, none worse.
# A HiGHS without these options leaves them out (setOptionValue answers an unknown name
# with an error status, not an exception; 1.15 checked): the same answers, only slower.
_FEASIBILITY_JUMP = False
# ... and its root reduced-cost heuristic (a sub-MIP over the columns of small reduced cost)
# off: GPT-39B's sampled solves 16.9 -> 11.1 s, the node-limited ones (whole stages, layers
# under a memory bound) 14.0 -> 9.8 s with 5 of 67 answers worse, by at most 0.057 %: within
# `ilp.PLAN_REL_GAP`, which every such answer was only proved to anyway.
_ROOT_REDUCED_COST = False
# Presolve rules off in the first nodes of an ``accept`` search (HiGHS's ``presolve_rule_off``
# bits, `_presolve_rules_off`): the aggregator, parallel rows and columns, sparsify and
# probing. That search is mostly its root (a stage's layer priced, a stage solved whole),
# where these rules reduce little (a 3,800-column MoE layer: 169 rows of 1,642) and probing
# the binaries took 0.10 s of a 0.17 s MIP. Sampled solves of five planning runs (GPT-39B,
# MoE-70B, BERT-MoE, BERT-Base and ViT on HAP's cluster), each as the planner solved it, one
# worker: those first 50 nodes 40.2 -> 23.6 s, none of the answers more than 0.1 % worse.
# A long search keeps them: a stage solved whole under a tight memory bound (5,000 nodes)
# took 11.4 s with probing and 19.7 s without; Wide-ResNet-4B's whole program on 16 V100s
# (unlimited) 10.3 and 21.3 s. Without any presolve (``presolve`` off) GPT-39B planned
# slower and worse. The aggregator with them: kept on (session 63), the sampled first nodes
# took 26.2 s instead of 23.7, and the intra-only rows of the weak-scaling suite searched
# 824.6 s instead of 684.8 (MoE-70B 234 s instead of 123: at 64 micro-batches its first 50
# nodes did not prove the plan within 0.5 %, and the search after them took 101 s). The one
# layer it had seemed to rescue (MoE-10B's, 63 s in the root's dual simplex with it off) was
# stalled by rounding residues among its costs, zero since (`_COST_NOISE`): 0.2 s so.
_PRESOLVE_RULES_OFF = ("Aggregator", "ParallelRowsAndCols", "Sparsify", "Probing")
# Largest cost coefficient handed to a backend (see the module docstring).
_COST_SCALE = 1e6
# Scaled costs smaller than this are set to zero: HiGHS cannot tell them from zero (its dual
# feasibility tolerance is 1e-7), they are rounding residues (1e-16 of the largest, a price
# less an equal one), and they stalled its dual simplex: one of MoE-10B's stage probes (1,969
# columns after presolve, scaled costs down to 2e-11) spent 64 s and 10,000 iterations in its
# first round of cuts, 0.2 s with them zero, the same answer. Over 409 other captured solves
# (MoE-70B's count 256, three intra-only rows' refinements) the same answers and times, but
# for one unaccepted 50-node probe that stopped at another point (gap 15 % for 10.5 %). Like
# any change of costs it moves some searches' paths: Wide-ResNet-4B's reduced intra-only plan,
# the same, took 35.4 s instead of 20.2 (one 5,000-node search 10.5 -> 20.7 s).
_COST_NOISE = 1e-7


@dataclass(frozen=True, eq=False)
class RawSolution:
    """Column values of a solved model, the relative gap left (0 = optimal) and how it ended."""

    x: np.ndarray
    gap: float
    how: str


def run_model(model: MilpModel, *, solver: str, lp_first: bool | None,
              time_limit_s: float | None, max_nodes: int | None = None,
              accept: tuple[int, float] | None = None,
              start: tuple[np.ndarray, np.ndarray] | None = None,
              rel_gap: float = 0.0, cutoff: float | None = None,
              search_on: bool = True, first_found: bool = False) -> RawSolution:
    """Solve ``model`` to optimality with the named backend (with ``rel_gap`` > 0: until its
    best point is proved within that relative gap of the optimum), or stop after
    ``max_nodes`` branch-and-bound nodes with the best point found (a run without one goes on
    unlimited; with ``search_on`` False it raises NodeLimitError instead).

    ``accept=(nodes, gap)`` stops the search once it has explored ``nodes`` nodes with its best
    point proved within the relative ``gap`` of the optimum; otherwise it goes on, up to
    ``max_nodes``. The planner's stage problems mostly find their optimum at the root and
    then spend minutes proving the last 0.1 % (GPT-2.6B's 8-block stage: 4.4 s to the plan,
    62 s to the proof); those first nodes are mostly the root, and such a search presolves
    without the rules only a long search gains from (`_PRESOLVE_RULES_OFF`). highspy checks
    ``accept`` in one search as it goes (`_Accept`); scipy, and a highspy without a
    subscribable MIP-interrupt callback (older releases), probe ``nodes`` nodes and then
    search again from the start (the better point is returned). ``start`` (column indices
    and values, possibly of some columns only) is a known point the search begins from
    (highspy; scipy takes none).

    ``lp_first=None`` tries the LP relaxation first only when the model has no coupling rows.

    ``cutoff``: only points of objective at most this are wanted; highspy then prunes by it
    (its ``objective_bound``) and raises IlpCutOffError when no point is that good (scipy has
    no such option: it solves as without one, and the caller compares).

    ``first_found``: the first point the search finds, whatever its cost (highspy; scipy
    searches on to the optimum): a point of the feasible set, in root-node time and the same
    on any machine, where a time limit would give another point on a slower one.

    Raises ValueError for an unknown solver, InfeasibleIlpError when the model has no feasible
    point, TimeoutError when ``time_limit_s`` passes before any feasible point is found.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS}")
    if model.num_cols == 0:
        return RawSolution(np.zeros(0), 0.0, "presolve")
    run = _run_highs if solver == "highs" else _run_scipy
    if cutoff is not None and solver == "highs":
        # Loosened a little: HiGHS prunes a point at the bound itself, found by other
        # arithmetic, as over it (by up to ~1e-8 of it measured: a point at 157894.73684 of
        # the scaled objective was pruned under 1e-9 more and kept under 1e-8; the caller
        # compares the point's own cost with the cutoff exactly).
        bound = cutoff * _cost_factor(model)
        run = _with_cutoff(bound + 1e-7 * abs(bound) + 1e-6)
    model = _normalize_costs(model)
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    if lp_first is None:
        lp_first = model.num_coupling_rows == 0
    if lp_first:
        relaxed = run(model, relax=True, deadline=deadline)
        if relaxed.gap == 0.0 and _is_integral(relaxed.x, model.integral):
            return RawSolution(relaxed.x, 0.0, f"{solver}:lp")
    if first_found and solver == "highs":
        raw = run(model, relax=False, deadline=deadline, start=start, first=True)
        assert raw is not None, "a search stopped at its first point has one"
        return raw
    if accept is not None and solver == "highs" and _interrupts():
        raw = run(model, relax=False, deadline=deadline, max_nodes=max_nodes, start=start,
                  rel_gap=rel_gap, light=True, accept=accept)
        return raw if raw is not None else _unlimited(run, model, deadline, rel_gap,
                                                      max_nodes, search_on)
    probe = None
    if accept is not None:
        probe_nodes, gap = accept
        if max_nodes is None or probe_nodes < max_nodes:
            probe = run(model, relax=False, deadline=deadline, max_nodes=probe_nodes,
                        start=start, rel_gap=rel_gap, light=True)
            if probe is not None and probe.gap <= gap:
                return probe
    # The search as without the probe: started from the probe's point, HiGHS took its own
    # path (a Wide-ResNet-13B plan on 64 V100s: 62 s to the proof, 17 s unstarted).
    raw = run(model, relax=False, deadline=deadline, max_nodes=max_nodes, start=start,
              rel_gap=rel_gap)
    if raw is None:
        raw = _unlimited(run, model, deadline, rel_gap, max_nodes, search_on)
    if probe is not None and float(model.cost @ probe.x) < float(model.cost @ raw.x):
        return probe   # stopped by the node limit short of the probe's point
    return raw


def _unlimited(run: Callable[..., RawSolution | None], model: MilpModel,
               deadline: float | None, rel_gap: float, max_nodes: int | None,
               search_on: bool) -> RawSolution:
    """The search without a node limit, where ``max_nodes`` came before any feasible point
    (NodeLimitError instead when not ``search_on``)."""
    if not search_on:
        raise NodeLimitError(f"{max_nodes} nodes searched without a feasible point")
    raw = run(model, relax=False, deadline=deadline, rel_gap=rel_gap)
    assert raw is not None
    return raw


def _interrupts() -> bool:
    """Whether the installed highspy takes Python MIP-interrupt callbacks (`_Accept`)."""
    return hasattr(_highspy().Highs, "cbMipInterrupt")


class _Accept:
    """A highspy MIP-interrupt callback that stops the search once it has explored ``nodes``
    nodes with its best point proved within ``gap``. Checked as the search goes: a probe of
    so many nodes that failed left a second search to redo the root (session 72, every
    accepting solve of MoE-70B's `auto` on 64 V100 and of BERT-MoE's on HAP's cluster
    replayed: 71.2 -> 55.8 s and 121.6 -> 96.6 s; 2 of 1,714 answers different, 0.03 % worse
    at most, within `ilp.PLAN_REL_GAP`). Node counts, not time: the same stop on any
    machine."""

    def __init__(self, nodes: int, gap: float) -> None:
        self.nodes, self.gap = nodes, gap

    def __call__(self, event: Any) -> None:
        out = event.data_out
        if out.mip_node_count >= self.nodes and out.mip_gap <= self.gap:
            event.data_in.user_interrupt = True


def _proved(gap: float | None, rel_gap: float) -> float:
    """The gap an optimal stop under ``rel_gap`` reports: the solver's, within [0, rel_gap]
    (missing or not finite: ``rel_gap``, all that is known)."""
    if gap is None or not math.isfinite(gap):
        return rel_gap
    return min(max(gap, 0.0), rel_gap)


def _cost_factor(model: MilpModel) -> float:
    """What `_normalize_costs` multiplies the objective by."""
    largest = float(np.abs(model.cost).max()) if model.cost.size else 0.0
    return 1.0 if largest == 0.0 else _COST_SCALE / largest


def _normalize_costs(model: MilpModel) -> MilpModel:
    """Scale the objective so its largest coefficient is ``_COST_SCALE`` (argmin unchanged), and
    zero the costs that are then under `_COST_NOISE`."""
    factor = _cost_factor(model)
    cost = model.cost * factor
    noise = (cost != 0.0) & (np.abs(cost) < _COST_NOISE)
    if factor == 1.0 and not noise.any():
        return model
    cost[noise] = 0.0
    return dataclasses.replace(model, cost=cost, offset=model.offset * factor)


def _with_cutoff(bound: float):
    """`_run_highs` pruning by ``bound`` (in the scaled objective's units), which raises
    IlpCutOffError where HiGHS proves no point within it."""
    def run(model: MilpModel, *, relax: bool, **kw) -> RawSolution | None:
        try:
            return _run_highs(model, relax=relax, objective_bound=None if relax else bound,
                              **kw)
        except InfeasibleIlpError as e:
            if relax:
                raise
            raise IlpCutOffError(f"no assignment costs at most the cutoff ({e})") from None
    return run


def _is_integral(x: np.ndarray, integral: np.ndarray) -> bool:
    values = x[integral]
    return bool(np.all(np.minimum(values, 1.0 - values) <= _INTEGRALITY_TOL))


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.perf_counter()
    if left <= 0:
        raise TimeoutError("the ILP time limit passed before a feasible assignment was found")
    return left


def _to_csc(model: MilpModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise (start, index, value) arrays of the constraint matrix, entries of the same
    (row, column) summed: the model may list one twice (a clause naming two aliased nodes),
    which HiGHS 1.15 reports and then never finishes presolving (scipy sums them itself)."""
    order = np.lexsort((model.rows, model.cols))
    rows, cols, vals = model.rows[order], model.cols[order], model.vals[order]
    first = np.ones(rows.size, dtype=bool)
    first[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    starts = np.flatnonzero(first)
    vals = np.add.reduceat(vals, starts) if vals.size else vals
    rows, cols = rows[starts], cols[starts]
    counts = np.bincount(cols, minlength=model.num_cols)
    start = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    return start, rows.astype(np.int32), vals


def _highspy():
    """highspy, imported when its backend is asked for: it is the default (``ilp.DEFAULT_SOLVER``)
    and a dependency of meshplan, but an environment assembled by hand may lack it."""
    try:
        import highspy
    except ImportError as e:
        raise ImportError("the 'highs' ILP backend (the default) needs highspy, a dependency of "
                          "meshplan: pip install 'highspy>=1.7'") from e
    return highspy


def _presolve_rules_off(version: tuple[int, int]) -> int:
    """The ``presolve_rule_off`` mask of `_PRESOLVE_RULES_OFF` for HiGHS ``version`` (major,
    minor): the rules' bits moved as HiGHS added rules (its ``PresolveRuleType``: sparsify at 14
    from 1.12, probing at 14 in 1.11 and at 15 from 1.12), so a rule of unknown place is left
    on."""
    places = {"Aggregator": 12, "ParallelRowsAndCols": 13}
    if version >= (1, 12):
        places.update(Sparsify=14, Probing=15)
    elif version >= (1, 11):
        places.update(Probing=14)
    return sum(1 << places[rule] for rule in _PRESOLVE_RULES_OFF if rule in places)


def _highs_lp(model: MilpModel) -> "highspy.HighsLp":  # noqa: F821
    """The model as a continuous HighsLp, passed in bulk (no per-nonzero Python calls)."""
    highspy = _highspy()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_ = model.cost
    lp.offset_ = model.offset
    lp.col_lower_, lp.col_upper_ = np.zeros(model.num_cols), model.upper
    lp.row_lower_, lp.row_upper_ = model.row_lower, model.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = _to_csc(model)
    return lp


def _run_highs(model: MilpModel, *, relax: bool, deadline: float | None,
               max_nodes: int | None = None,
               start: tuple[np.ndarray, np.ndarray] | None = None,
               rel_gap: float = 0.0, objective_bound: float | None = None,
               light: bool = False, accept: tuple[int, float] | None = None,
               first: bool = False) -> RawSolution | None:
    """``light``: the presolve of a search that is mostly its root (`_PRESOLVE_RULES_OFF`);
    ``accept``: `_Accept`'s stop; ``first``: stop at the first point found."""
    highspy = _highspy()
    lp = _highs_lp(model)
    h = highspy.Highs()
    # One thread: HiGHS's worker threads live in a process-wide scheduler that a forked child
    # inherits without its threads, so a solve in the planner's forked workers
    # (`stage_costs._run_tasks`) after a multi-threaded solve in the parent waits forever. Its
    # default is half the cores: 1 on a 2-core machine, which hid this; 8 on the first GPU
    # machine tried, where the 2-stage pipeline's planning hung. Our MIPs are solved serially.
    for name, value in (("output_flag", False), ("threads", 1),
                        ("mip_rel_gap", rel_gap), ("mip_abs_gap", 0.0),
                        ("mip_allow_restart", _ALLOW_RESTART),
                        ("mip_pscost_minreliable", _PSCOST_MIN_RELIABLE),
                        ("mip_heuristic_run_feasibility_jump", _FEASIBILITY_JUMP),
                        ("mip_heuristic_run_root_reduced_cost", _ROOT_REDUCED_COST)):
        h.setOptionValue(name, value)
    left = _remaining(deadline)
    if left is not None:
        h.setOptionValue("time_limit", left)
    if max_nodes is not None and not relax:
        h.setOptionValue("mip_max_nodes", max_nodes)
    if first and not relax:
        h.setOptionValue("mip_max_improving_sols", 1)
    if light:
        h.setOptionValue("presolve_rule_off",
                         _presolve_rules_off((h.versionMajor(), h.versionMinor())))
    if objective_bound is not None:
        h.setOptionValue("objective_bound", objective_bound)
    h.passModel(lp)
    if not relax:
        binaries = np.flatnonzero(model.integral).astype(np.int32)
        h.changeColsIntegrality(binaries.size, binaries, np.ones(binaries.size, dtype=np.uint8))
        if start is not None:
            h.setSolution(start[0].size, start[0], start[1])
    if accept is not None and not relax:
        h.cbMipInterrupt.subscribe(_Accept(*accept))
    h.run()
    status = h.getModelStatus()
    how = "highs:lp" if relax else "highs:mip"
    if status == highspy.HighsModelStatus.kOptimal:
        # Optimal within ``rel_gap``: what it proved, at most that (an unknown one is that).
        gap = _proved(float(h.getInfo().mip_gap), rel_gap) if not relax else 0.0
        return RawSolution(np.asarray(h.getSolution().col_value), gap, how)
    if status in (highspy.HighsModelStatus.kInfeasible,
                  highspy.HighsModelStatus.kUnboundedOrInfeasible):
        raise InfeasibleIlpError("no strategy assignment satisfies the constraints (HiGHS "
                                 f"proved the {'LP relaxation' if relax else 'MILP'} infeasible)")
    info = h.getInfo()
    found = info.primal_solution_status == highspy.kSolutionStatusFeasible
    # Stopped by the time limit or by `_Accept` (a MIP only) with a point found.
    if status in (highspy.HighsModelStatus.kTimeLimit,
                  highspy.HighsModelStatus.kInterrupt) and found:
        gap = np.inf if relax else float(info.mip_gap)  # a stopped LP proves nothing
        return RawSolution(np.asarray(h.getSolution().col_value), gap, how)
    if status == highspy.HighsModelStatus.kTimeLimit:
        raise TimeoutError("the ILP time limit passed before a feasible assignment was found")
    if (max_nodes is not None or first) and \
            status == highspy.HighsModelStatus.kSolutionLimit:
        # The node limit (or the first point's): the best point so far and its gap, or None
        # when there is none.
        return RawSolution(np.asarray(h.getSolution().col_value), float(info.mip_gap), how) \
            if found else None
    raise RuntimeError(f"HiGHS stopped with status {h.modelStatusToString(status)}")


def _run_scipy(model: MilpModel, *, relax: bool, deadline: float | None,
               max_nodes: int | None = None,
               start: tuple[np.ndarray, np.ndarray] | None = None,
               rel_gap: float = 0.0, light: bool = False) -> RawSolution | None:
    # scipy.optimize.milp takes no starting point (``start`` is ignored) nor presolve rules
    # (``light`` is).
    try:  # scipy is optional: only this backend needs it
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as exc:
        raise ImportError("solver='scipy' needs scipy installed; solver='highs' needs only "
                          "highspy") from exc

    matrix = csr_array((model.vals, (model.rows, model.cols)),
                       shape=(model.num_rows, model.num_cols))
    options: dict[str, float | bool] = {"mip_rel_gap": rel_gap, "presolve": True}
    if max_nodes is not None:
        options["node_limit"] = max_nodes
    left = _remaining(deadline)
    if left is not None:
        options["time_limit"] = left
    constraints = (LinearConstraint(matrix, model.row_lower, model.row_upper)
                   if model.num_rows else ())
    result = milp(model.cost, integrality=np.zeros(model.num_cols) if relax else model.integral,
                  bounds=Bounds(np.zeros(model.num_cols), model.upper),
                  constraints=constraints, options=options)
    how = "scipy:lp" if relax else "scipy:mip"
    if result.status == 0:
        gap = _proved(getattr(result, "mip_gap", None), rel_gap) if not relax else 0.0
        return RawSolution(np.asarray(result.x), gap, how)
    if result.status == 2:
        raise InfeasibleIlpError("no strategy assignment satisfies the constraints (HiGHS via "
                                 "scipy proved the model infeasible)")
    if result.status == 1 and result.x is not None:
        gap = None if relax else getattr(result, "mip_gap", None)
        return RawSolution(np.asarray(result.x), np.inf if gap is None else float(gap), how)
    if max_nodes is not None and result.status == 4 and "Solution limit" in result.message:
        # The node limit (scipy names HiGHS's status only by its message): the best point so
        # far, or None when there is none.
        if getattr(result, "x", None) is None:
            return None
        gap = getattr(result, "mip_gap", None)
        return RawSolution(np.asarray(result.x), np.inf if gap is None else float(gap), how)
    if result.status == 1:
        raise TimeoutError("the ILP time limit passed before a feasible assignment was found")
    raise RuntimeError(f"scipy.optimize.milp stopped with status {result.status}: "
                       f"{result.message}")
