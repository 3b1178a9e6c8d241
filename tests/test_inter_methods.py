"""Planning methods of the inter-operator pass besides the search: Megatron-LM's configurations
(one as given, and the fastest of the grid) and Alpa's equal-operator ablation, on a tiny GPT
and the cost model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.cli import EXIT_USAGE, main
from meshplan.plan.plan import plan_from_json
from meshplan.planner.inter.clustering import cluster_layers
from meshplan.planner.inter.manual import megatron_grid
from meshplan.planner.inter.search import REFINE_MARGIN
from meshplan.planner.inter.megatron_spec import (MegatronSpec, factorizations,
                                                  parse_megatron_spec, stage_submesh)
from meshplan.planner.inter.stage_problem import pipeline_latency
from meshplan.zoo.spec import build_workload

TINY = "gpt:hidden=64,layers=4,heads=4,seq=32,vocab=128,batch=16"
FOUR = "p3.16xlarge:1x4"
V100_BYTES = 16 * 2**30


@pytest.fixture(scope="module")
def tiny():
    return build_workload(TINY, device="meta")


def _plan(w, cluster: str, **kw) -> api.Plan:
    return api.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, **kw)


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize("text,spec", [
    ("megatron:dp=2,tp=4,pp=2,mb=1", MegatronSpec(2, 4, 2, 1)),
    ("megatron:pp=2, tp=1 ,dp=8", MegatronSpec(8, 1, 2)),
    ("megatron:dp=1,tp=1,pp=1,virtual=1", MegatronSpec(1, 1, 1)),
])
def test_good_specs_parse_and_print_back(text: str, spec: MegatronSpec) -> None:
    assert parse_megatron_spec(text) == spec
    assert parse_megatron_spec(str(spec)) == spec


@pytest.mark.parametrize("text,needles", [
    ("megatron:dp=2,tp=4", ["missing pp", "megatron:dp=D,tp=T,pp=P"]),
    ("megatron:dp=2,tp=4,pp=2,foo=1", ["unknown key 'foo'", "dp, tp, pp, mb, virtual"]),
    ("megatron:dp=0,tp=4,pp=2", ["dp='0'", "positive integer"]),
    ("megatron:dp=2,tp=-1,pp=2", ["tp='-1'", "positive integer"]),
    ("megatron:dp=2,tp=4,pp=two", ["pp='two'", "positive integer"]),
    ("megatron:dp=2,dp=2,tp=1,pp=1", ["dp given twice"]),
    ("megatron:dp2,tp=1,pp=1", ["'dp2' is not key=value"]),
])
def test_bad_specs_name_the_bad_part(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_megatron_spec(text)
    for needle in needles:
        assert needle in str(err.value)


def test_virtual_stages_need_a_pipeline() -> None:
    assert parse_megatron_spec("megatron:dp=1,tp=2,pp=2,virtual=2").virtual == 2
    with pytest.raises(ValueError, match="pp=1 has none"):
        parse_megatron_spec("megatron:dp=2,tp=1,pp=1,virtual=2")


def test_interleaving_shrinks_the_bubble_when_micro_batches_are_few() -> None:
    """Megatron's configuration with as many micro-batches as stages: 2 chunks per device
    halve the bubble, so the interleaved step is shorter (Megatron-LM's finding), as the
    schedule's latency says; the schedules must agree with the configuration."""
    w = build_workload("gpt:hidden=2048,layers=8,heads=16,seq=512,vocab=1024,batch=8",
                       device="meta")

    def plan(method: str, schedule: str = "auto") -> api.Plan:
        return api.plan(w.model, w.loss_fn, "adamw", w.example_batch, "dgx-a100:1x8",
                        memory_budget_gb=0, microbatches=4, method=method, schedule=schedule)

    flat, chunked = plan("megatron:dp=1,tp=2,pp=4"), plan("megatron:dp=1,tp=2,pp=4,virtual=2")
    assert (flat.schedule, flat.chunks) == ("1f1b", 1)
    assert (chunked.schedule, chunked.chunks, chunked.num_stages) == ("interleaved", 2, 8)
    assert chunked.options["megatron"]["virtual"] == 2
    assert chunked.predicted["step_time_s"] < 0.9 * flat.predicted["step_time_s"]
    with pytest.raises(ValueError, match="schedule 'interleaved' or 'auto'"):
        plan("megatron:dp=1,tp=2,pp=4,virtual=2", "1f1b")
    with pytest.raises(ValueError, match="needs virtual stages"):
        plan("megatron:dp=1,tp=2,pp=4", "interleaved")


def test_factorizations_and_stage_submeshes() -> None:
    assert factorizations(4) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                 (4, 1, 1)]
    assert stage_submesh(4, 8) == (1, 4) and stage_submesh(16, 8) == (2, 8)
    with pytest.raises(ValueError, match="whole hosts"):
        stage_submesh(12, 8)


def test_grid_enumerates_what_a_megatron_user_tries() -> None:
    grid = megatron_grid(1, 4, 16)
    assert {(s.dp, s.tp, s.pp) for s in grid} == set(factorizations(4))
    assert {s.mb for s in grid} == {1, 2, 4, 8}
    assert all((16 // s.dp) % s.mb == 0 for s in grid)
    assert {(s.dp, s.mb) for s in megatron_grid(1, 4, 16, microbatches=2)} == {
        (1, 8), (2, 4), (4, 2)}
    assert all(s.tp <= 8 for s in megatron_grid(2, 8, 64))   # tensor parallel within a host


@pytest.mark.parametrize("method,kw,match", [
    ("megatron:dp=2,tp=2,pp=2", {}, "cluster has 4 devices; valid factorizations: "
                                    "dp=1,tp=1,pp=4, dp=1,tp=2,pp=2"),
    ("megatron:dp=2,tp=2,pp=1,mb=3", {}, r"valid mb: \[1, 2, 4, 8\]"),
    ("megatron:dp=2,tp=2,pp=1,mb=2", {"microbatches": 4}, "microbatches='auto'"),
    ("megatron:dp=2,tp=2,pp=1", {"mesh_shape": (2, 2)}, "no mesh_shape"),
    ("megatron-grid", {"alpha": (1, 1), "beta": (1, 1)}, "no mesh_shape and no alpha/beta"),
])
def test_configurations_that_cannot_be_planned(tiny, method: str, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(tiny, FOUR, method=method, **kw)


def test_pp_must_divide_the_blocks(tiny) -> None:
    with pytest.raises(ValueError, match=r"pp=3 does not divide the model's 4 repeated blocks,"
                                         r".*valid pp: \[1, 2, 4\]"):
        _plan(tiny, "p3.16xlarge:1x3", method="megatron:dp=1,tp=1,pp=3")


# ---------------------------------------------------------------- one configuration


def test_pipeline_of_equal_stages(tiny) -> None:
    p = _plan(tiny, "p3.16xlarge:1x2", method="megatron:dp=1,tp=1,pp=2")
    assert p.method == "megatron:dp=1,tp=1,pp=2" and p.num_layers == 4
    assert [(s.layers, s.submesh, s.mesh_shape, s.devices) for s in p.stages] == [
        ((0, 2), (1, 1), (1, 1), (0,)), ((2, 4), (1, 1), (1, 1), (1,))]
    assert p.options["megatron"] == {"dp": 1, "tp": 1, "pp": 2, "mb": 16 // p.microbatches,
                                     "virtual": 1}
    assert "megatron: dp=1,tp=1,pp=2,mb=" in p.explain()


def test_data_times_tensor_parallel_stage(tiny) -> None:
    p = _plan(tiny, FOUR, method="megatron:dp=2,tp=2,pp=1,mb=2")
    assert p.microbatches == 16 // (2 * 2) and p.mesh_shape == (2, 2)
    assert [(s.submesh, s.mesh_shape) for s in p.stages] == [((1, 4), (2, 2))]
    matmuls = [o.strategy.split() for o in p.ops if o.op == "mm"]
    assert matmuls and all("i:S0" in s for s in matmuls)                 # batch on axis 0
    assert all("j:S1" in s or "k:S1" in s for s in matmuls)              # tensor parallel
    assert p.param("blocks.0.mlp.fc_in.weight").spec == "S1,R"           # column parallel
    assert p.param("blocks.0.mlp.fc_out.weight").spec == "R,S1"          # row parallel


# ---------------------------------------------------------------- the grid


@pytest.fixture(scope="module")
def grid(tiny) -> api.Plan:
    return _plan(tiny, FOUR, method="megatron-grid")


def _pipeline_step(p: api.Plan) -> float:
    """The step the searches compare (Alpa eq. 2 over the stages' priced latencies). A plan of
    one stage predicts its own whole-mesh solve instead."""
    return pipeline_latency(tuple(s.latency_s for s in p.stages), p.microbatches)


def test_grid_is_the_fastest_configuration_that_fits(tiny, grid: api.Plan) -> None:
    assert grid.method == "megatron-grid" and grid.predicted["peak_memory_bytes"] <= V100_BYTES
    table = grid.options["megatron_grid"]
    assert len(table) == grid.ilp["configs_priced"] == len(megatron_grid(1, 4, 16))
    # Ranked by the DP's estimate; the near-best (within REFINE_MARGIN) are solved whole and
    # the fastest of those is the grid's choice.
    best_estimate = min(r["step_time_s"] for r in table if r["step_time_s"])
    assert best_estimate <= grid.ilp["estimated_step_s"] <= (1 + REFINE_MARGIN) * best_estimate
    chosen = grid.options["megatron"]
    assert grid.microbatches == 16 // (chosen["dp"] * chosen["mb"])
    for dp, tp, pp, mb in [(1, 2, 2, 4), (2, 2, 1, 2), (4, 1, 1, 4), (2, 1, 2, 1)]:
        one = _plan(tiny, FOUR, method=f"megatron:dp={dp},tp={tp},pp={pp},mb={mb}")
        assert one.options["megatron"] == {"dp": dp, "tp": tp, "pp": pp, "mb": mb,
                                           "virtual": 1}
        row = next(r for r in table if (r["dp"], r["tp"], r["pp"], r["mb"]) == (dp, tp, pp, mb))
        # The grid ranks configurations by the DP's estimate (stages priced by parts)
        assert row["step_time_s"] == pytest.approx(one.ilp["estimated_step_s"])
        assert best_estimate <= one.ilp["estimated_step_s"]


def test_grid_round_trips_and_explains_its_choice(grid: api.Plan) -> None:
    assert plan_from_json(grid.to_json()) == grid
    c = grid.options["megatron"]
    assert (f"megatron: dp={c['dp']},tp={c['tp']},pp={c['pp']},mb={c['mb']} (the fastest of"
            in grid.explain())


def test_auto_is_no_slower_than_the_megatron_grid(tiny) -> None:
    """The issue's plan-quality criterion, at one micro-batch count to keep it quick."""
    auto = _plan(tiny, FOUR, microbatches=2)
    best = _plan(tiny, FOUR, method="megatron-grid", microbatches=2)
    assert best.microbatches == 2
    assert auto.predicted["step_time_s"] <= best.predicted["step_time_s"] * (1 + 1e-9)
    if auto.num_stages > 1 and best.num_stages > 1:   # both predict eq. 2's step
        assert _pipeline_step(auto) <= _pipeline_step(best)


# ---------------------------------------------------------------- equal operator


def test_equal_operator_layers_hold_equal_op_counts(tiny) -> None:
    graph = capture(tiny.model, tiny.loss_fn, tiny.example_batch)[1]
    for num_layers in (3, 4, 7):
        layering = cluster_layers(graph, num_layers, balance="ops")
        counts = [sum(graph.by_name[x].role == "op" for x in names) for names in layering.layers]
        assert max(counts) - min(counts) <= 1
        assert sum(counts) == sum(n.role == "op" for n in graph.nodes)
    with pytest.raises(ValueError, match="balance='size'"):
        cluster_layers(graph, 3, balance="size")


def test_equal_operator_runs_the_stage_dp(tiny) -> None:
    p = _plan(tiny, "p3.16xlarge:1x2", method="equal-operator", microbatches=2, num_layers=4)
    assert p.method == "equal-operator" and p.num_layers == 4
    assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == 4
    assert sum(len(s.devices) for s in p.stages) == 2


# ---------------------------------------------------------------- command line


def test_cli_plans_a_megatron_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", TINY, "--cluster", FOUR, "--method", "megatron:dp=1,tp=2,pp=2",
                 "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    doc = json.loads(out)
    assert doc["method"] == "megatron:dp=1,tp=2,pp=2"
    assert doc["options"]["megatron"]["tp"] == 2 and len(doc["stages"]) == 2
    assert [s["mesh_shape"] for s in doc["stages"]] == [[1, 2], [1, 2]]


def test_cli_names_a_bad_megatron_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", TINY, "--cluster", FOUR, "--method", "megatron:dp=2"])
    _, err = capsys.readouterr()
    assert code == EXIT_USAGE and "missing tp, pp" in err and "Traceback" not in err


# ---------------------------------------------------------------- whole solves decide


def test_candidates_solved_whole_never_lose_to_the_dps_own_pick(tiny, monkeypatch) -> None:
    # By parts the DP misjudges long stages; its near-best pipelines (equal stages included),
    # each stage on its best logical mesh, are solved whole and the fastest kept. With one
    # candidate and a margin of zero that is the DP's own pick as it stood before. (The
    # one-stage checks, which may trade the pipeline for one stage on a near-tie, have their
    # own tests below: off here, where their whole solves under this budget took 29 s a plan.)
    import meshplan.planner.inter.search as search
    monkeypatch.setattr(search, "_one_stage_if_simulated_faster", lambda plan, *_: plan)
    monkeypatch.setattr(search, "_weighs_one_stage", lambda req: False)
    kw = dict(microbatches=2, memory_budget_gb=0.004)
    chosen = _plan(tiny, FOUR, **kw)
    monkeypatch.setattr(search, "REFINE_MAX", 1)
    monkeypatch.setattr(search, "REFINE_MARGIN", 0.0)
    own = _plan(tiny, FOUR, **kw)
    assert chosen.num_stages > 1
    assert chosen.predicted["step_time_s"] <= own.predicted["step_time_s"] * (1 + 1e-12)
    assert chosen.predicted["peak_memory_bytes"] <= 0.004 * 2**30
    assert chosen.ilp["estimated_step_s"] == own.ilp["estimated_step_s"]


def test_the_fastest_equal_stage_pipeline_is_solved_whole(tiny, monkeypatch) -> None:
    """Besides the DP's near-best pipelines, the fastest of equal stages is solved whole
    wherever its by-parts estimate lies (GPT-39B on 64 V100: the grid's 16 stages of 3 layers
    were 95.9 s by parts, 22 % behind the DP's pick, and 77.6 s solved whole, 1.3 % ahead)."""
    import meshplan.planner.inter.search as search
    monkeypatch.setattr(search, "_weighs_one_stage", lambda req: False)
    monkeypatch.setattr(search, "REFINE_MAX", 1)
    monkeypatch.setattr(search, "REFINE_MARGIN", 0.0)
    rounds, solve = [], search._solved_whole

    def spy(profiler, round_, req):
        rounds.append(round_.near)
        return solve(profiler, round_, req)
    monkeypatch.setattr(search, "_solved_whole", spy)
    _plan(tiny, FOUR, microbatches=2, memory_budget_gb=0.004)
    assert rounds
    for near in rounds:   # the DP's own pick, then the equal stages unless it is one
        assert len(near) == 1 + (not search._even(near[0]))
        assert search._even(near[-1])


def test_inter_only_skips_submeshes_its_restriction_cannot_plan() -> None:
    """Inter-only stages are data parallel only: at one sample per micro-batch a stage on two
    devices has no plan at all, which rules that option out instead of ending the search
    (it raised InfeasibleIlpError from the lean-memory pricing)."""
    w = build_workload("wresnet:preset=500m,batch=1536", device="meta")
    p = api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "p3.16xlarge:1x2",
                 method="inter-only", dtype="fp32")
    assert p.num_stages >= 2
    assert sorted({d for s in p.stages for d in s.devices}) == [0, 1]


def test_auto_weighs_a_pipeline_as_the_simulator_runs_it() -> None:
    """On two hosts of four GPUs joined by 25 Gb/s, the activations a pipeline sends between
    stages and the tied embedding's gradient the stages exchange make the DP's pipeline slower
    than one stage over all eight, as the simulator runs it — so auto answers one stage, and
    says why. The pipeline's estimate prices both as the simulator does (it once left them
    out and was 1.3x under)."""
    from meshplan.demo_pipeline import OPT, SPEC
    from meshplan.sim.simulate import simulate
    w = build_workload(SPEC, device="meta")
    plan = api.plan(w.model, w.loss_fn, OPT, w.example_batch, "p3.16xlarge:2x4", dtype="fp32",
                    memory_budget_gb=0)
    check = plan.options["pipeline_check"]
    assert plan.num_stages == 1
    assert check["pipeline_estimated_s"] == pytest.approx(check["pipeline_simulated_s"],
                                                          rel=0.05)
    assert check["one_stage_s"] < check["pipeline_simulated_s"]
    # One stage at the search's count, or intra-only's at fewer micro-batches where faster
    # (`api._weighs_intra_only`).
    assert simulate(plan).step_time_s <= check["one_stage_s"] * (1 + 1e-9)
    # Where the pipeline stays the faster, as simulated, it is kept (hosts of two): the demo's
    # own plan (the same request on p3.16xlarge:2x2, made once for this and the demo's test).
    from test_demo_pipeline import demo_plan
    kept = demo_plan(4)
    assert kept.num_stages >= 2 and "one_stage_s" not in kept.options["pipeline_check"]


def test_one_stage_far_slower_than_the_pipeline_is_not_simulated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one stage's fastest estimate is `search.ONE_STAGE_WITHIN` times the pipeline's
    prediction or more, the pipeline is not simulated to weigh it (a long pipeline's simulation
    costs seconds): the check records both estimates and keeps the pipeline. The demo's
    pipeline on two hosts of two: one stage over all four estimated 15x slower."""
    import meshplan.planner.inter.search as search
    import meshplan.sim.simulate as sim
    from meshplan.demo_pipeline import OPT, SPEC
    w = build_workload(SPEC, device="meta")
    kw = dict(dtype="fp32", memory_budget_gb=0, method="inter-only")
    with monkeypatch.context() as m:
        m.setattr(search, "ONE_STAGE_WITHIN", math.inf)
        weighed = api.plan(w.model, w.loss_fn, OPT, w.example_batch, "p3.16xlarge:2x2", **kw)
    assert weighed.num_stages >= 2 and "pipeline_simulated_s" in weighed.options[
        "pipeline_check"]
    monkeypatch.setattr(sim, "simulate", lambda plan: pytest.fail("simulated"))
    p = api.plan(w.model, w.loss_fn, OPT, w.example_batch, "p3.16xlarge:2x2", **kw)
    check = p.options["pipeline_check"]
    def layout(plan):
        return [(s.layers, s.devices, s.mesh_shape, s.recompute) for s in plan.stages]
    assert layout(p) == layout(weighed)
    assert set(check) == {"pipeline_estimated_s", "one_stage_estimated_s"}
    assert check["one_stage_estimated_s"] >= search.ONE_STAGE_WITHIN * check[
        "pipeline_estimated_s"]


def test_auto_on_one_host_weighs_intra_onlys_plan() -> None:
    """On one host auto also weighs intra-only's plan (one stage at the fewest micro-batches
    that fit, which the pipeline search's walk down from the most does not reach) and takes
    the faster of those that fit as simulated; explain says which. Which one wins depends on
    the budget: under a tight one, one stage at more micro-batches can fit a plan that
    communicates less (here the search's one stage at 16 micro-batches, 0.5 % ahead)."""
    w = build_workload("gpt:hidden=512,layers=4,heads=8,seq=256,vocab=4096,batch=64",
                       device="meta")
    kw = dict(dtype="fp16", memory_budget_gb=0.3)
    p = api.plan(w.model, w.loss_fn, "adam", w.example_batch, FOUR, **kw)
    check = p.options["single_stage_check"]
    steps = check["step_s"]
    intra = api.plan(w.model, w.loss_fn, "adam", w.example_batch, FOUR, method="intra-only",
                     **kw)
    assert steps["one stage"] == intra.predicted["step_time_s"]
    assert not check["over_budget_simulated"]
    assert check["chosen"] == min(steps, key=steps.get)
    assert p.predicted["step_time_s"] == min(steps.values())
    assert p.predicted["peak_memory_bytes"] <= 0.3 * 2**30
    assert f"intra-only check chose the {check['chosen']}" in p.explain()


@pytest.mark.parametrize("pipeline_step,fitted", [(1e-9, False), (1e9, True)],
                         ids=["pipeline-faster", "pipeline-slower"])
def test_a_one_stage_plan_slower_than_a_pipeline_that_fits_is_not_fitted(
        pipeline_step: float, fitted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitted under the budget as simulated (`api._within_as_simulated`: solved again under
    a lower bound), a one-stage plan is no faster: where it already loses to a pipeline that
    fits, it is weighed as it is and the pipeline chosen; where it may win, it is fitted
    first."""
    w = build_workload("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=8",
                       device="meta")
    searched = api._plan_pipeline

    def piped(*args, **kwargs):
        p = searched(*args, **kwargs)
        return replace(p, predicted={**p.predicted, "step_time_s": pipeline_step})

    monkeypatch.setattr(api, "_plan_pipeline", piped)
    # The first count's plan a byte over as simulated: fitting it means solving again.
    real_over, first = api._over, []
    monkeypatch.setattr(api, "_over", lambda plan, budget: 1.0 if not first and not
                        first.append(1) else real_over(plan, budget))
    fits = api._within_as_simulated
    calls = []
    monkeypatch.setattr(api, "_within_as_simulated",
                        lambda *a, **k: calls.append(1) or fits(*a, **k))
    p = api.plan(w.model, w.loss_fn, "adam", w.example_batch, FOUR, dtype="fp16",
                 memory_budget_gb=0.3)
    check = p.options["single_stage_check"]
    assert bool(calls) is fitted
    assert "pipeline" not in check["over_budget_simulated"]
    assert check["chosen"] == ("one stage" if fitted else "pipeline")


def test_auto_weighs_intra_only_on_one_host_or_where_it_answered_one_stage() -> None:
    """When "auto" also plans intra-only's single stage (`api._weighs_intra_only`): on one
    host always; across hosts only when the search answered one stage (GPT-6.7B's widths, 4
    layers, batch 64 on 16 V100: one stage at 64 micro-batches 0.706 s, at one 0.624 s),
    even at the fewest micro-batches (the search's one stage is not intra-only's plan: GPT-15B's
    widths on 32 V100s, 0.1449 s against intra-only's 0.1421)."""
    from types import SimpleNamespace as NS
    one_host, two_hosts = NS(num_hosts=1), NS(num_hosts=2)
    for stages, micro, cluster, weighs in [(3, 8, one_host, True), (1, 8, one_host, True),
                                           (1, 1, one_host, True), (3, 8, two_hosts, False),
                                           (1, 8, two_hosts, True), (1, 1, two_hosts, True)]:
        piped = NS(num_stages=stages, microbatches=micro)
        assert api._weighs_intra_only(piped, cluster) is weighs, (stages, micro)


@pytest.mark.parametrize("over,chosen", [({1: 5.0, 2: 3.0}, 4),
                                         ({1: 5.0, 2: 3.0, 4: 4.0, 8: 6.0}, 2)],
                         ids=["a-later-count-fits", "none-fits"])
def test_a_one_stage_plan_over_as_simulated_goes_on_to_more_microbatches(
        over: dict[int, float], chosen: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-stage plan the ILP fits but whose transients take it over the budget as
    simulated, refitted in vain (`api._within_as_simulated`), gives way to the next count (more
    micro-batches hold less): the fewest micro-batches that fit as simulated, else the count
    whose plan is least over."""
    w = build_workload("gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8",
                       device="meta")
    monkeypatch.setattr(api, "_over", lambda plan, budget: over.get(plan.microbatches, 0.0))
    p = api.plan(w.model, w.loss_fn, "adam", w.example_batch, FOUR, method="intra-only",
                 dtype="fp32", memory_budget_gb=8)
    assert p.microbatches == chosen


@pytest.mark.parametrize("steps,binds,chosen,tried", [
    ({1: 3.0, 2: 2.0, 4: 2.5, 8: 1.0}, True, 2, [1, 2, 4]),
    ({1: 3.0, 2: 2.0, 4: 1.5, 8: 1.0}, True, 8, [1, 2, 4, 8]),
    ({1: 3.0, 2: 2.0, 4: 2.5, 8: 1.0}, False, 1, [1])], ids=["binds", "binds-to-the-last", "free"])
def test_a_one_stage_plan_the_budget_binds_walks_on_while_faster(
        steps: dict[int, float], binds: bool, chosen: int, tried: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the budget costs a single-stage plan time, more micro-batches (fewer activations
    each) may buy faster layouts than they cost: the counts are walked up while each plan is
    faster than the last; where the budget does not bind, the fewest micro-batches that fit
    are the plan (more only add latency)."""
    from types import SimpleNamespace as NS
    w = build_workload("gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8",
                       device="meta")
    seen = []

    def one_stage(found, *args):
        num = found[4].microbatches   # the CostContext of the count's solve
        seen.append(num)
        return api._OneStage(NS(microbatches=num, predicted={"step_time_s": steps[num]}),
                             0.0, binds)

    monkeypatch.setattr(api, "_one_stage", one_stage)
    p = api._plan(w.model, w.loss_fn, "adam", w.example_batch, FOUR, method="intra-only",
                  dtype="fp32", memory_budget_gb=8)
    assert (p.microbatches, seen) == (chosen, tried)


def test_whether_the_budget_binds_a_single_stage_plan() -> None:
    """`api._budget_binds`: the fastest plan without the budget faster than the budget's by
    more than the solves' gap."""
    from meshplan.planner.intra.ilp import plan_solve
    from meshplan.planner.intra.ilp_problem import IlpProblem
    # Two nodes, strategy 0 fast and large, 1 slow and small; one live set of both.
    problem = IlpProblem(((1.0, 2.0), (1.0, 2.0)), node_memory=((4.0, 1.0), (4.0, 1.0)),
                         live_sets=((0, 1),))
    for budget, binds in ((8.0, False), (5.0, True), (2.0, True)):
        tight = replace(problem, memory_budget=budget)
        assert api._budget_binds(tight, plan_solve(tight)) is binds, budget
    assert not api._budget_binds(problem, plan_solve(problem))


@pytest.mark.parametrize("excesses,kept", [((1, 5, 3, 2), 0), ((1, 5, 0), 2), ((0,), 0)],
                         ids=["none-fits", "a-later-round-fits", "fits-at-once"])
def test_fitting_as_simulated_keeps_the_first_fit_or_the_plan_least_over(
        excesses: tuple[int, ...], kept: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`api._within_as_simulated` solves again under a lower bound while the simulated peak
    exceeds the budget; each round's plan has transients of its own and may be over by more
    than the last: the first plan that fits is returned, else the one least over, each with
    the bytes it is over by."""
    import math
    import types

    import meshplan.sim.simulate as sim
    from meshplan.planner.intra.ilp_problem import IlpProblem
    budget, rounds = 100.0, iter(range(1, len(excesses)))
    sol = types.SimpleNamespace(choices=())
    monkeypatch.setattr(api, "_peak_bound", lambda plan: math.inf)
    monkeypatch.setattr(sim, "simulate", lambda plan: types.SimpleNamespace(
        peak_memory_bytes=[budget + excesses[plan]]))
    monkeypatch.setattr(api, "peak_memory", lambda problem, choices: budget)
    monkeypatch.setattr(api, "plan_solve", lambda problem: sol)
    monkeypatch.setattr(api, "_refine", lambda problem, found: found)
    got = api._within_as_simulated(0, IlpProblem(((0.0,),), node_memory=((0.0,),),
                                                  live_sets=((0,),)), sol, budget,
                                   lambda s: next(rounds))
    assert got == (kept, excesses[kept])
