"""Stage pricing for the stage DP at scale: layer-by-layer recomputation, chosen stages solved
whole with their in-flight memory, forked pricing equal to serial, mirror logical shapes,
host-granular search, and the micro-batch memory floor."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import meshplan.api as api
import meshplan.planner.inter.stage_costs as stage_costs
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OptimizerState
from meshplan.cost.precision import with_compute_dtype
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.memory_floor import CountFloors
from meshplan.planner.inter.stage_costs import StageLabel, StageProfiler
from meshplan.planner.inter.stage_dp import solve_stage_dp
from meshplan.planner.inter.stage_problem import ClusterShape, PipelineProblem, submesh_shapes
from meshplan.planner.inter.stage_tables import _flatten, profile_all
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import renamed
from meshplan.planner.intra.ilp import min_memory, peak_memory, solve
from meshplan.zoo.spec import build_workload

GPT = "gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=8"
BUDGET = 3.0 * 2**20   # bytes per device: tight enough that memory shapes the choices


@pytest.fixture(scope="module")
def program():
    w = build_workload(GPT, device="meta")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    graph = with_compute_dtype(graph, "fp16")
    return graph, cluster_layers(graph, 6)


def _profiler(program, cluster: str = "p3.16xlarge:1x4", **kw) -> StageProfiler:
    graph, layering = program
    return StageProfiler(graph, layering, parse_cluster_spec(cluster),
                         IntraOptions(optimizer="adamw", memory_budget=BUDGET), OptimizerState(), 2, BUDGET,
                         **kw)


def test_long_ranges_recompute_layer_by_layer(program) -> None:
    """A recomputed range keeps each layer's inputs per micro-batch and one layer's
    activations at a time (Megatron's full recomputation), priced from one-layer solves."""
    prof = _profiler(program)
    sub, shape = (1, 2), (1, 2)
    layers = [prof._exact(m, m + 1, sub, shape, "free") for m in range(1, 5)]
    options = {(o.label.logical_shape, o.label.budget, o.label.recompute): o
               for o in prof(1, 5, sub)}
    plain, rc = options[(shape, "free", False)], options[(shape, "free", True)]
    state = sum(c.state for c in layers)
    assert rc.state_bytes == pytest.approx(state + max(c.act for c in layers))
    assert rc.activation_bytes == pytest.approx(sum(c.inputs for c in layers))
    assert plain.state_bytes == pytest.approx(state)
    assert plain.activation_bytes == pytest.approx(sum(c.act + c.inputs for c in layers))
    assert rc.latency > plain.latency   # the forward runs twice


def test_forked_pricing_equals_serial(program, monkeypatch: pytest.MonkeyPatch) -> None:
    serial, forked = _profiler(program), _profiler(program)
    submeshes = ((1, 1), (1, 2), (1, 4))
    serial.prefetch(submeshes, workers=1)
    monkeypatch.setattr(stage_costs, "PARALLEL_FROM_TASKS", 1)
    forked.prefetch(submeshes, workers=2)
    assert forked._costed == serial._costed and forked.solves == serial.solves > 0
    chosen = [(0, 2, (1, 2), StageLabel((1, 2), "lean", True), 2),
              (2, 4, (1, 1), StageLabel((1, 1), "free", False), 2),
              (4, 6, (1, 1), StageLabel((1, 1), "free", False), 1)]
    a, b = serial.solutions(chosen, workers=1), forked.solutions(chosen, workers=2)
    assert [(s.solution.choices, s.latency, s.memory_bytes) for s in a] == \
        [(s.solution.choices, s.latency, s.memory_bytes) for s in b]


def test_chosen_stages_fit_with_their_in_flight_micro_batches(program) -> None:
    prof = _profiler(program)
    prof.memory_limit = limit = 3 * BUDGET
    label = StageLabel((1, 2), "lean", False)
    one, three = prof.solutions([(1, 4, (1, 2), label, 1), (1, 4, (1, 2), label, 3)])
    assert one.memory_bytes <= limit and three.memory_bytes <= limit
    # The same structure, submesh and plan kind share one solve (at the most in flight).
    assert one.solution.choices == three.solution.choices
    assert three.memory_bytes > one.memory_bytes   # activations counted once per micro-batch


def test_identical_layers_share_their_stage_ilps(program,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPT's four identical blocks are priced as one: each distinct layer structure once
    per submesh, logical shape and variant, however many layers share it."""
    prof = _profiler(program)
    priced: list[tuple] = []
    price = StageProfiler._price

    def counted(self, start, end, submesh, shape, budget):
        priced.append((self.key(start, end), submesh, shape, budget))
        return price(self, start, end, submesh, shape, budget)

    monkeypatch.setattr(StageProfiler, "_price", counted)
    sub = (1, 2)
    prof.prefetch((sub,), workers=1)
    keys = {prof.key(m, m + 1) for m in range(prof.layering.num_layers)}
    assert len(keys) == 3   # the embedding's layer, the blocks, the head's
    per_key = {(sub, shape, b) for shape in prof.shapes(sub) for b in prof.variants(sub, shape)}
    assert len(priced) == len(set(priced))
    for key in keys:
        assert {(s, shape, b) for k, s, shape, b in priced if k == key} == per_key
    # Besides: the end layers' other parts, each priced once to check whether their parts
    # price them (`layer_parts.py`; here they do not, so they are priced whole).
    parts = [p for p in priced if p[0] not in keys]
    assert len(parts) == 2 and all(p[3] == "free" for p in parts)
    assert not prof._by_parts(0) and not prof._by_parts(5)


def test_a_whole_stage_problem_is_solved_once(program, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranges of one structure on one logical mesh, priced by different variants ("free",
    "lean", "tp"), are one whole ILP: solved once, counted once, one answer."""
    prof = _profiler(program)
    solves = []
    solve = stage_costs.plan_solve
    monkeypatch.setattr(stage_costs, "plan_solve",
                        lambda *a, **k: solves.append(1) or solve(*a, **k))
    assert prof.key(1, 3) == prof.key(3, 5)
    first = prof.whole_cost(1, 3, (1, 2), StageLabel((1, 2), "free", False), 2)
    again = prof.whole_cost(3, 5, (1, 2), StageLabel((1, 2), "lean", False), 2)
    chosen = prof.solutions([(1, 3, (1, 2), StageLabel((1, 2), "tp", False), 2)])[0]
    assert len(solves) == prof.solves == 1
    assert first == again
    # The plan's stage reports the ILP's peak (the simulator adds the transients itself); the
    # fit is judged with them.
    assert first[0] == chosen.latency
    assert first[1] == pytest.approx(chosen.memory_bytes + stage_costs.transient_bytes(chosen))


def test_a_whole_solve_gives_each_block_its_own_plan(program, monkeypatch) -> None:
    """The stage formulation ties repeated blocks to one plan (its aliases, for the one-layer
    pricing); a whole solve unties them: under a memory bound the fastest stage may mix plans
    across its blocks, which is what the whole solve is there to find. Solved whole, a stage
    of four blocks is the untied ILP's optimum, here under a bound where it is strictly faster
    than the tied one."""
    sub, shape, label = (1, 2), (1, 2), StageLabel((1, 2), "free", False)
    prof = _profiler(program)
    form = prof._form(1, 5, sub, shape)
    assert form.problem.aliases
    weighted = stage_costs._in_flight_problem(form, prof.stage(1, 5), None, 2)
    low = min_memory(weighted)
    high = peak_memory(weighted, solve(replace(weighted, live_sets=())).choices)
    tied = untied = None
    for budget in np.linspace(low, high, 5)[1:-1]:
        untied = solve(replace(weighted, memory_budget=budget, aliases=()))
        tied = solve(replace(weighted, memory_budget=budget))
        if tied.objective > untied.objective * (1 + 1e-6):
            break
    assert tied.objective > untied.objective * (1 + 1e-6)   # some bound makes blocks differ
    # The ILP's bound alone (the transients' re-solve is tested on its own).
    monkeypatch.setattr(stage_costs, "transient_bytes", lambda *a: 0.0)
    bounded = StageProfiler(*program, parse_cluster_spec("p3.16xlarge:1x4"),
                            IntraOptions(optimizer="adamw", memory_budget=budget),
                            OptimizerState(), 2, budget)
    whole = bounded._solve_whole(1, 5, sub, label, 2)[0]
    assert whole.objective == pytest.approx(untied.objective, rel=1e-9)


def _whole_under(program, budget: float, label: StageLabel):
    """Layers [1, 5) on a (1, 2) submesh, 2 in flight, solved whole under ``budget``."""
    return StageProfiler(*program, parse_cluster_spec("p3.16xlarge:1x4"),
                         IntraOptions(optimizer="adamw", memory_budget=budget),
                         OptimizerState(), 2, budget)._solve_whole(1, 5, (1, 2), label, 2)[0]


@pytest.mark.parametrize("recompute,fraction", [(False, 0.7), (True, 0.22)])
def test_a_whole_solve_fits_with_the_transients_the_simulator_holds(
        program, monkeypatch, recompute: bool, fraction: float) -> None:
    """The simulator holds a stage's op-by-op transients beyond the ILP's live sets: plain, a
    backward's gradients in flight next to those held; recomputed, the largest pass beyond
    the layers' inputs kept per micro-batch (a layer's replayed activations with the
    backward's gradients in flight), of which the in-flight ILP holds one segment's
    activations. A whole solve whose plan fits the ILP's bound but not with them is solved
    again under the bound less them; without them the plan is over the bound as run."""
    label = StageLabel((1, 2), "free", recompute)
    prof = _profiler(program)
    form = prof._form(1, 5, (1, 2), (1, 2))
    segments = prof.segments(prof.stage(1, 5), 4, label)
    assert (segments is not None) == recompute
    weighted = stage_costs._in_flight_problem(form, prof.stage(1, 5), segments, 2)
    low = min_memory(weighted)
    budget = low + fraction * (peak_memory(weighted, solve(replace(
        weighted, live_sets=())).choices) - low)
    transients = stage_costs.transient_bytes

    def as_run(sol) -> float:
        peak = peak_memory(weighted, sol.choices)
        return peak + transients(stage_costs.StageSolution(form, sol, prof.stage(1, 5)),
                                 segments, peak, 2)

    assert as_run(_whole_under(program, budget, label)) <= budget
    monkeypatch.setattr(stage_costs, "transient_bytes", lambda *a: 0.0)
    assert as_run(_whole_under(program, budget, label)) > budget   # the ILP's bound alone


def test_mirror_logical_shapes_are_priced_once(program) -> None:
    assert _profiler(program).shapes((1, 4)) == [(1, 4), (2, 2)]
    # On two hosts the axes of (2, 2) have different links: both orders are different
    # problems, but (1, 4) and (4, 1) move everything over the one axis of four devices.
    assert _profiler(program, "p3.16xlarge:2x2").shapes((2, 2)) == [(1, 4), (2, 2)]
    on = {s: _profiler(program, "p3.16xlarge:2x2", logical_shapes=frozenset({s}))
          for s in ((1, 4), (4, 1))}
    priced = {s: [(o.latency, o.state_bytes, o.activation_bytes, o.label.budget,
                   o.label.kind) for m in range(6) for o in prof(m, m + 1, (2, 2))]
              for s, prof in on.items()}
    assert priced[(1, 4)] and priced[(1, 4)] == priced[(4, 1)]
    forced = _profiler(program)
    forced.options = IntraOptions(optimizer="adamw", force_batch_axis=0)
    assert forced.shapes((1, 4)) == [(1, 4), (2, 2), (4, 1)]


def test_a_multi_host_submesh_prices_no_mesh_whose_two_axes_cross_hosts(program) -> None:
    """On hosts of 8, a stage of 3 hosts is priced on (3, 8), (6, 4), (12, 2) and the ring of
    all 24, not on (2, 12), (4, 6) or (8, 3), whose axes both cross hosts; host-granular
    searches price the same shapes (the ring as (24, 1)); one host's stage every shape; a
    method's own shape always."""
    prof = _profiler(program, "p3.16xlarge:3")
    assert prof.shapes((3, 8)) == [(1, 24), (3, 8), (6, 4), (12, 2)]
    assert prof.shapes((2, 8)) == [(1, 16), (2, 8), (4, 4), (8, 2)]
    assert prof.shapes((1, 8)) == [(1, 8), (2, 4)]
    granular = _profiler(program, "p3.16xlarge:3", tensor_within_host=True)
    assert granular.shapes((3, 8)) == [(3, 8), (6, 4), (12, 2), (24, 1)]
    own = _profiler(program, "p3.16xlarge:3", logical_shapes=frozenset({(2, 12)}))
    assert own.shapes((3, 8)) == [(2, 12)]


def test_many_hosts_are_planned_host_granular() -> None:
    """Beyond 8 hosts stages take whole hosts and keep tensor parallelism inside one."""
    w = build_workload("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=32",
                       device="meta")
    p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:16x2",
                 memory_budget_gb=0, microbatches=4, num_layers=4)
    devices = sorted(d for s in p.stages for d in s.devices)
    assert devices == list(range(32))
    for s in p.stages:
        assert s.submesh[1] == 2 and s.submesh[0] in (1, 2, 4, 8, 16)
        assert s.submesh[0] == 1 or 2 % s.mesh_shape[1] == 0


def test_memory_floor_bounds_every_plan_from_below(program) -> None:
    """Without recomputation every kept activation and the state, over the devices; with it
    the state and the batch only (a replayed stage never holds all its layers at once)."""
    graph, _ = program
    floors = CountFloors(lambda b: graph, "fp16", OptimizerState(), 4, 1.0)
    w = build_workload(GPT, device="meta")
    p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1x4",
                 memory_budget_gb=0, microbatches=1, dtype="fp16", method="intra-only")
    assert 0 < floors.floor(1) <= p.predicted["peak_memory_bytes"]
    assert not floors.may_fit(1)   # a one-byte budget
    replayed = CountFloors(lambda b: graph, "fp16", OptimizerState(), 4, 1.0, recompute=True)
    assert 0 < replayed.floor(1) < floors.floor(1)


def test_a_budget_that_only_recomputation_meets(program) -> None:
    """Just below the smallest budget any pipeline without recomputation meets (found by
    bisection), some pipeline with recomputed stages still fits, and every stage keeps
    within it."""
    # Long sequences, narrow layers: activations dominate, as where recomputation pays.
    w = build_workload(GPT.replace("seq=16", "seq=64").replace("hidden=64", "hidden=32"),
                       device="meta")

    def plan(budget: float, recompute: str) -> api.Plan | None:
        try:
            return api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1x4",
                            microbatches=2, recompute=recompute, memory_budget_gb=budget / 2**30,
                            num_layers=6, method="inter-only")
        except api.InfeasiblePlanError:
            return None

    fits = plan(8 * 2**20, "none")
    assert fits is not None
    lo, hi = 0.0, max(s.memory_bytes for s in fits.stages)
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if plan(mid, "none") is not None else (mid, hi)
    p = plan(lo, "auto")
    assert p is not None and any(s.recompute for s in p.stages)
    assert all(s.memory_bytes <= lo for s in p.stages)


def test_a_pipeline_that_fits_only_by_parts_is_searched_again(monkeypatch) -> None:
    """Where every candidate solved whole is over the budget as the simulator runs it (the
    transients beyond what the DP left), the DPs run again under the budget less the excess
    and the plan fits as simulated; without that the DP's pick was kept, over the budget."""
    from meshplan.planner.inter import search
    from meshplan.sim.simulate import simulate
    w = build_workload(GPT.replace("seq=16", "seq=64").replace("hidden=64", "hidden=32"),
                       device="meta")
    # Where the DP's pick solved whole is over as simulated and the refit's fits, in fp32:
    # 1.20-1.24 MB here (1.26 MB runs the DP's pick, 1.20 MB the refit's).
    budget = 1_230_000

    def peak() -> float:
        p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1x4",
                     microbatches=2, memory_budget_gb=budget / 2**30, num_layers=6,
                     method="inter-only", dtype="fp32")
        return max(simulate(p).peak_memory_bytes)

    # The equal-stage candidate solved whole fits here on its own: off, so that the DP's
    # candidates are all there is, as the refit is for.
    monkeypatch.setattr(search, "_even", lambda pipeline: False)
    assert peak() <= budget
    monkeypatch.setattr(search, "REFIT_ROUNDS", 0)
    assert peak() > budget


@pytest.mark.parametrize("recompute,cluster,exact_up_to",
                         [(rc, cl, 1) for rc in ("auto", "none", "full")
                          for cl in ("p3.16xlarge:1x4", "p3.16xlarge:2x2")]
                         # exact two-layer ranges solve every range whole: 15 s a case
                         + [("auto", "p3.16xlarge:1x4", 2)])
def test_option_table_is_the_profile_in_bulk(program, recompute: str, cluster: str,
                                             exact_up_to: int) -> None:
    """The DP's bulk table lists, bit for bit and in the same order per range, what asking the
    profile range by range gives (whole-model range and exact short ranges included), and the
    DP finds the same pipeline either way."""
    prof = _profiler(program, cluster, recompute=recompute, exact_up_to=exact_up_to)
    c = prof.cluster
    shape = ClusterShape(c.num_hosts, c.devices_per_host)
    shapes = submesh_shapes(shape)
    plain = PipelineProblem(shape, prof.layering.num_layers, prof, 4, device_memory=BUDGET)
    bulk = replace(plain, table=prof.option_table)
    by_range = _flatten(profile_all(plain, shapes), plain.num_layers, len(shapes))
    table = prof.option_table(shapes)
    a = np.lexsort((by_range["position"], by_range["triple"]))
    b = np.lexsort((table.position, table.triple))
    assert a.size == b.size > 0
    for name in ("latency", "state", "activation", "triple", "position"):
        assert np.array_equal(by_range[name][a], getattr(table, name)[b]), name
    one, two = solve_stage_dp(plain), solve_stage_dp(bulk)
    assert one.stages == two.stages and one.total_latency == two.total_latency


def test_a_parameter_several_layers_use_is_never_zero_sharded(program) -> None:
    """GPT's tied embedding is read by the first layer and the last: stages holding it sum its
    gradient whole across meshes, so the profiler plans it with replicated updates even under
    a budget that makes ZeRO pay for the others."""
    from meshplan.planner.inter.stage_costs import shared_params
    graph, layering = program
    shared = shared_params(graph, layering)
    params = {n.name: n for n in graph.nodes if n.role == "param"}
    assert len(shared) == 1 and params[next(iter(shared))].state_name == "wte.weight"
    prof = _profiler(program)
    assert shared <= prof.options.replicated_updates
    choices = resolve_choices(prof.stage(0, 1), (1, 4), prof.options)
    modes = {name: {c.mode for c in choices.choices[name]} for name in params
             if name in choices.choices}
    (tied,) = shared
    assert modes[tied] == {"replicated"}
    assert any("zero3" in m for name, m in modes.items() if name != tied)


def test_a_mixed_option_is_its_parts_priced_layer_by_layer(program) -> None:
    """A range's mixed options (`StageProfiler._mixes`): its first q quarters of layers on the
    fastest plan, the rest on a lean one, priced as the sum of those one-layer plans (and the
    inbound transfer once), listed only where the split is new and the range is long."""
    prof = _profiler(program)
    sub, shape = (1, 2), (1, 2)
    mixes = prof._mixes(sub, shape)
    assert {(fast, lean) for _, fast, lean, _ in mixes} == {("free", "lean"), ("free", "deep")}
    for start, end in [(0, 2), (1, 5), (0, 6)]:
        listed = {o.label.budget: o for o in prof(start, end, sub)
                  if o.label.logical_shape == shape}
        count, splits = end - start, set()
        for budget, fast, lean, q in mixes:
            mid = start + count * q // 4
            if (lean, mid) in splits or not start < mid < end:
                assert budget not in listed
                continue
            splits.add((lean, mid))
            parts = [prof._exact(m, m + 1, sub, shape, fast if m < mid else lean)
                     for m in range(start, end)]
            o = listed[budget]
            assert o.label.kind == "plain"
            assert o.latency == pytest.approx(sum(c.latency for c in parts)
                                              + prof.transfer_time(start))
            assert o.state_bytes == pytest.approx(sum(c.state for c in parts))
            assert o.activation_bytes == pytest.approx(sum(c.act + c.inputs for c in parts))
    assert not any("+" in o.label.budget for o in prof(2, 3, sub))   # one layer: no mix


def test_the_deep_variant_is_lean_with_an_early_stages_micro_batches(program) -> None:
    """"deep" is the fastest plan within 5 % of the smallest memory with `deep_in_flight`
    micro-batches kept (one stage per submesh of the cluster, at most the step's count):
    never more memory at that count than "lean", and listed only where a stage on the
    submesh can keep more than one."""
    # Layer by layer as solved (not the end layers' parts, `layer_parts.py`): here only the
    # end layers, the embedding's and the head's, have a "deep" plan unlike "lean".
    prof = _profiler(program, "p3.16xlarge:1x8", in_parts=False)
    assert prof.deep_in_flight((1, 2)) == min(prof.microbatches, 4)
    assert "deep" not in prof.variants((1, 8), (1, 8))    # one stage: one micro-batch
    leaner = 0
    for sub in [(1, 1), (1, 2), (1, 4)]:
        k = prof.deep_in_flight(sub)
        for m in range(6):
            for shape in prof.shapes(sub):
                held = {b: c.state + k * (c.act + c.inputs) for b in prof.variants(sub, shape)
                        if (c := prof._exact(m, m + 1, sub, shape, b)) is not None}
                assert held["deep"] <= 1.05 * min(held.values()) * (1 + 1e-9)
                leaner += held["deep"] < held["lean"] * (1 - 1e-6)
    assert leaner   # somewhere "lean" (one micro-batch) is not the leanest at k


def test_the_tp_variant_keeps_its_weights_split_as_megatron_does(program) -> None:
    """"tp" is Megatron-LM's plan of a layer: the batch on axis 0, and every weight matrix
    split over the tensor axis (`IntraOptions.tensor_weights`). Without that rule its
    time-optimal plan replicated the weights and split the sequence instead, the "free"
    plan again (GPT-39B on (1, 4): 12 GiB of weights a layer against Megatron's 3), so the
    by-parts table never held the memory between the fastest plan and the leanest."""
    prof = _profiler(program)
    sub = shape = (1, 2)
    assert "tp" in prof.variants(sub, shape)
    for m in range(1, 5):   # the blocks: each weight matrix read by a matmul
        form = prof._form(m, m + 1, sub, shape, True)
        weights = [n for n in form.choices.graph.nodes
                   if n.role == "param" and len(n.out.shape) >= 2]
        assert weights
        for n in weights:
            layouts = {c.strategy.output for c in form.choices.choices[n.name]}
            assert all(1 in lay.split_axes for lay in layouts), (n.name, layouts)
        tp = prof._exact(m, m + 1, sub, shape, "tp")
        free = prof._exact(m, m + 1, sub, shape, "free")
        assert tp is not None and tp.state < free.state


def test_each_stage_says_what_it_gave_up_for_memory(tmp_path) -> None:
    """Issue 27.2: a pipeline's stages record what they chose for memory, and `explain`
    says what each choice saved and cost: the replay's bytes per device and seconds a step,
    the parameters under ZeRO-2/3 and the state that saves (`StageProfiler.tradeoffs`).
    Wide layers and short sequences under a tight budget: both ZeRO and recomputation."""
    from meshplan.plan.plan import load_plan
    w = build_workload("gpt:hidden=256,layers=4,heads=4,seq=8,vocab=256,batch=16",
                       device="meta")
    plan = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "p3.16xlarge:1x8",
                    microbatches=4, memory_budget_gb=12 / 1024, num_layers=4,
                    method="inter-only")
    assert plan.num_stages > 1
    step = plan.predicted["step_time_s"]
    for s in plan.stages:
        t = s.tradeoffs
        assert ("recompute_saved_bytes" in t) == s.recompute
        if s.recompute:
            assert 0 < t["recompute_saved_bytes"] < s.memory_bytes
            assert 0 < t["recompute_cost_s"] < step
        # The counts are the stage plan's own parameters by update mode.
        updates = [p.update for p in s.plan.params]
        for mode in ("zero2", "zero3"):
            assert t.get(f"{mode}_params", 0) == updates.count(mode), (mode, updates)
        if updates.count("zero2") + updates.count("zero3"):
            assert t["zero_saved_bytes"] > 0
    assert any(s.recompute for s in plan.stages)
    assert any(s.tradeoffs.get("zero2_params") for s in plan.stages)
    lines = [l for l in plan.explain().splitlines() if l.startswith("    for memory: ")]
    assert len(lines) == sum(bool(s.tradeoffs) for s in plan.stages)
    assert any("the replay saves" in l and "ZeRO-2 on" in l for l in lines)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert [s.tradeoffs for s in load_plan(path).stages] == [s.tradeoffs for s in plan.stages]


def test_a_whole_solve_under_a_bound_is_cut_only_where_it_cannot_beat_it(program) -> None:
    """`whole_cost_below`: a stage solved whole under the best latency another of its options
    reached is cut off (None) only where its own whole solve is not under that latency, and
    otherwise answers exactly what the whole solve does (the pipeline picks as before)."""
    full, bounded = _profiler(program), _profiler(program)
    cases = [(start, end, StageLabel(shape, "free", rc), n)
             for start, end in ((0, 2), (1, 3), (3, 5)) for shape in ((1, 4), (2, 2))
             for rc in (False, True) for n in (1, 2)]
    costs = {c: full.whole_cost(c[0], c[1], (1, 4), c[2], c[3]) for c in cases}
    cut = kept = 0
    for (start, end, label, n), (latency, memory) in costs.items():
        others = {v[0] for k, v in costs.items() if k[:2] == (start, end) and k[3] == n}
        for bound in sorted(others | {0.5 * latency, latency * (1 + 1e-6)}):
            got = bounded.whole_cost_below(start, end, (1, 4), label, n, bound)
            if got is None:
                assert latency >= bound * (1 - 1e-9), (start, end, label, n, bound)
                cut += 1
            else:
                assert got == (latency, memory)
                kept += 1
    assert cut >= 5 and kept >= 5, (cut, kept)


def test_a_structure_formulated_once_names_each_range(program) -> None:
    """Stages of one structure share one formulation, renamed for each (`renamed`): it is
    the formulation their own program gives, name for name; one of another structure, or
    whose parameter an option singles out, is not renamed."""
    prof = _profiler(program)
    sub, shape = (1, 2), (1, 2)
    assert prof.key(2, 4) == prof.key(3, 5) != prof.key(0, 2)
    first, own = prof._formulate(2, 4, sub, shape), prof._formulate(3, 5, sub, shape)
    named = renamed(first, prof.stage(3, 5))
    assert named is not None and named.roots == own.roots
    for field in ("root_of", "main_of", "choices", "batch_dims"):
        assert getattr(named.choices, field) == getattr(own.choices, field)
    assert named.choices.graph is prof.stage(3, 5)
    a, b = named.problem, own.problem
    assert [list(r) for r in a.node_costs] == [list(r) for r in b.node_costs]
    assert [list(r) for r in a.node_memory] == [list(r) for r in b.node_memory]
    assert [(e.u, e.v, np.asarray(e.costs).tolist()) for e in a.edges] == \
        [(e.u, e.v, np.asarray(e.costs).tolist()) for e in b.edges]
    assert (a.live_sets, a.aliases, a.shared, a.overlap, a.tie_leaves) == \
        (b.live_sets, b.aliases, b.shared, b.overlap, b.tie_leaves)
    # A whole solve's choices read through either: the same plan.
    sol = solve(first.problem)
    assert [named.choices.choices[r][c] for r, c in zip(named.roots, sol.choices)] == \
        [own.choices.choices[r][c] for r, c in zip(own.roots, sol.choices)]
    assert renamed(first, prof.stage(0, 2)) is None
    param = next(n.name for n in prof.stage(3, 5).nodes if n.role == "param")
    assert renamed(first, prof.stage(3, 5), frozenset({param})) is None
