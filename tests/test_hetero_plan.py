"""Planning for mixed clusters (HAP, issue 10): per-device compute prices, the "hetero" method
against the homogeneous ILP where both apply, the alternating ratio/program loop against its
data-parallel baselines, planning time on HAP's 64-GPU cluster, and the refused requests."""

from __future__ import annotations

import functools

import pytest

import meshplan
from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import Cluster, mixed_cluster
from meshplan.cost.compute import forward_backward_times
from meshplan.cost.devices import DEVICE_TYPES, Link, link_preset
from meshplan.cost.mesh import LogicalMesh
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.op_costs import CostContext, OpCosts
from meshplan.zoo.spec import Workload, build_workload
from hetero_cases import MODELS, four_speeds

V100, P100 = DEVICE_TYPES["V100-SXM2-16GB"], DEVICE_TYPES["P100-SXM2-16GB"]
HAP_CLUSTER = "examples/clusters/hap_v100_p100.yaml"


@functools.cache
def workload(spec: str) -> Workload:
    """One workload per spec for the module: kept alive, its capture is made once."""
    return build_workload(spec)


def plan(spec: str, cluster: Cluster | str, method: str, **kw: object) -> meshplan.Plan:
    w = workload(spec)
    return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, method=method,
                         **kw)


# -- compute priced device by device (CostContext.devices) -------------------------------------

@pytest.mark.parametrize(("ratios", "slowest"), [((0.8, 0.2), V100), ((0.5, 0.5), P100)],
                         ids=["v100-paces", "p100-paces"])
def test_split_work_is_priced_at_the_slowest_share_and_replicated_at_the_slowest_device(
        ratios: tuple[float, float], slowest: object) -> None:
    w = workload("mlp:layers=2,hidden=64,batch=8")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    nc = resolve_choices(graph, (1, 2), IntraOptions())
    mesh = LogicalMesh((1, 2), (0.0, 1e-5), (0.0, 1e-9), weights=((1.0,), ratios))
    ctx = CostContext(mesh, P100, devices=(V100, P100), microbatches=3, recompute=True)
    costs = OpCosts(nc, ctx)
    node = graph.by_name["mm"]
    by_axes = {c.strategy.work_axes: c for c in nc.choices["mm"]}
    split, replicated = by_axes[(1,)], by_axes[()]

    def alone(device: object, share: float) -> tuple[float, float]:
        return forward_backward_times(node.flops * share, node.nbytes * share, device,
                                      "float32", 2.0)

    per_device = [alone(V100, ratios[0]), alone(P100, ratios[1])]
    expected = (max(t[0] for t in per_device), max(t[1] for t in per_device))
    assert costs.pass_times(node, split) == pytest.approx(expected)
    # The max is reached on the device the case names, and is not the other's time.
    assert expected == per_device[(V100, P100).index(slowest)] != per_device[slowest is V100]
    assert costs.pass_times(node, replicated) == pytest.approx(alone(P100, 1.0))
    assert alone(P100, 1.0)[0] > alone(V100, 1.0)[0]
    assert costs.compute_cost(node, split) == pytest.approx(3 * (2 * expected[0] + expected[1]))
    assert ctx.rank_shares((1,)) == ((V100, pytest.approx(ratios[0])),
                                     (P100, pytest.approx(ratios[1])))
    assert ctx.rank_shares(()) == ((V100, 1.0), (P100, 1.0))


def test_one_device_type_with_even_weights_is_the_homogeneous_price() -> None:
    w = workload("mlp:layers=2,hidden=64,batch=8")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    nc = resolve_choices(graph, (1, 4), IntraOptions())
    plain = LogicalMesh((1, 4), (0.0, 1e-5), (0.0, 1e-9))
    even = LogicalMesh((1, 4), (0.0, 1e-5), (0.0, 1e-9), weights=((1.0,), (1, 1, 1, 1)))
    homogeneous = OpCosts(nc, CostContext(plain, V100))
    typed = OpCosts(nc, CostContext(even, V100, devices=(V100,) * 4))
    for node in graph.nodes:
        for choice in nc.choices[node.name]:
            assert typed.pass_times(node, choice) == pytest.approx(
                homogeneous.pass_times(node, choice))
    mm = graph.by_name["mm"]
    split = next(c for c in nc.choices["mm"] if c.strategy.work_axes == (1,))
    assert homogeneous.pass_times(mm, split) == pytest.approx(
        forward_backward_times(mm.flops / 4, mm.nbytes / 4, V100, "float32", 2.0))


# -- a homogeneous cluster: "hetero" finds the ILP's optimum ------------------------------------

ZOO = {
    "gpt": "gpt:hidden=256,layers=2,heads=8,seq=128,vocab=1024,batch=16",
    "moe": "moe:hidden=128,layers=2,heads=4,experts=8,seq=64,vocab=512,batch=8",
    "wresnet": "wresnet:layers=26,channels=16,width=2,image=32,classes=100,batch=32",
    "vgg19": "vgg19:channels=16,fc=512,image=32,classes=10,batch=32",
    "bert": "bert:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=16",
    "vit": "vit:hidden=256,layers=2,heads=8,patch=4,image=32,classes=10,batch=16",
}


@pytest.mark.parametrize("name", list(ZOO))
def test_hetero_on_a_homogeneous_cluster_matches_the_ilp(name: str) -> None:
    hetero = plan(ZOO[name], "p3.16xlarge:1x4", "hetero", memory_budget_gb=16)
    ilp = plan(ZOO[name], "p3.16xlarge:1x4", "intra-only", mesh_shape=(1, 4),
               memory_budget_gb=16)
    assert hetero.method == "hetero" and hetero.mesh_shape == (1, 4)
    assert hetero.options["hetero"]["ratios"] == pytest.approx([0.25] * 4)
    assert hetero.objective <= ilp.objective * (1 + 1e-9), (hetero.objective, ilp.objective)
    step, ilp_step = hetero.predicted["step_time_s"], ilp.predicted["step_time_s"]
    assert step == pytest.approx(ilp_step, rel=0.01)


# -- mixed clusters: the alternating loop and its baselines -------------------------------------

def v100_p100() -> Cluster:
    """Two hosts: two V100s on NVLink, two P100s; 25 Gb/s Ethernet between them."""
    return mixed_cluster("v100-p100", [[V100, V100], [P100, P100]], link_preset("nvlink-v100"),
                         link_preset("25gbe"))


CLUSTERS = {"four-speeds": four_speeds, "v100-p100": v100_p100}
MIXED_MODELS = {**MODELS, "gpt": "gpt:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=16"}


@functools.cache
def mixed_plan(cluster: str, model: str, method: str) -> meshplan.Plan:
    return plan(MIXED_MODELS[model], CLUSTERS[cluster](), method)


CASES = [(c, m) for c in CLUSTERS for m in MIXED_MODELS]


@pytest.mark.parametrize(("cluster", "model"), CASES)
def test_the_loop_gives_each_device_a_ratio_and_records_its_rounds(cluster: str,
                                                                   model: str) -> None:
    p, cl = mixed_plan(cluster, model, "hetero"), CLUSTERS[cluster]()
    h = p.options["hetero"]
    assert p.method == "hetero" and p.mesh_shape == (1, cl.num_devices)
    assert len(h["ratios"]) == cl.num_devices and min(h["ratios"]) >= 0
    assert sum(h["ratios"]) == pytest.approx(1.0)
    assert p.axis_weights[0] == (1.0,) and p.axis_weights[1] == pytest.approx(h["ratios"])
    assert h["device_types"] == [t.name for t in cl.types]
    assert h["rounds"] and h["search_states"] > 0
    assert p.options["gather_impl"] == "auto"


@pytest.mark.parametrize("baseline", ["dp-proportional", "dp-even"])
@pytest.mark.parametrize(("cluster", "model"), CASES)
def test_hetero_objective_is_no_worse_than_data_parallelism(cluster: str, model: str,
                                                            baseline: str) -> None:
    hetero, dp = mixed_plan(cluster, model, "hetero"), mixed_plan(cluster, model, baseline)
    assert dp.method == baseline and not dp.options["hetero"].get("rounds")
    assert hetero.objective <= dp.objective * (1 + 1e-9), (hetero.objective, dp.objective)


# The objective charges the update phase's bucketed synchronizations without their latency
# (one per bucket, not per parameter: `op_costs.sync_cost`), so the program it prefers is
# also the faster one by the prediction, even where latency dominates (tiny models).
STEP_CASES = [(c, m, b) for c, m in CASES for b in ("dp-proportional", "dp-even")]


@pytest.mark.parametrize(("cluster", "model", "baseline"), STEP_CASES)
def test_hetero_predicted_step_is_no_slower_than_data_parallelism(cluster: str, model: str,
                                                                  baseline: str) -> None:
    hetero, dp = mixed_plan(cluster, model, "hetero"), mixed_plan(cluster, model, baseline)
    step, dp_step = hetero.predicted["step_time_s"], dp.predicted["step_time_s"]
    assert step <= dp_step * (1 + 1e-9), (step, dp_step)


def test_baselines_fix_their_ratios() -> None:
    even = mixed_plan("four-speeds", "bert", "dp-even").options["hetero"]["ratios"]
    proportional = mixed_plan("four-speeds", "bert", "dp-proportional").options["hetero"]
    assert even == pytest.approx([0.25] * 4)
    assert proportional["ratios"] == pytest.approx([0.4, 0.3, 0.2, 0.1])   # 4:3:2:1 in speed


def test_fixed_ratios_skip_balancing() -> None:
    # Even ratios on devices 4:3:2:1 in speed: the balancer would move them; fixed, it may not.
    for weights in (((1.0,), (1, 1, 1, 1)), ((2.0,), (4, 3, 2, 1))):
        p = plan(MODELS["bert"], four_speeds(), "hetero", axis_weights=weights)
        expected = [x / sum(weights[1]) for x in weights[1]]
        assert p.options["hetero"]["ratios"] == pytest.approx(expected)
        assert p.axis_weights[1] == pytest.approx(expected)
        assert len(p.options["hetero"]["rounds"]) == 1
    balanced = mixed_plan("four-speeds", "bert", "hetero")
    assert balanced.options["hetero"]["ratios"] != pytest.approx([0.25] * 4)


def test_the_loop_never_synthesizes_twice_for_the_same_ratios(monkeypatch) -> None:
    # Ratios that come back to an earlier round's would synthesize that round's program
    # again (a budget-bound program can take HiGHS minutes): the loop stops there. Here it
    # starts even, the balancer answers the speed shares, then even again.
    import meshplan.planner.hetero.alternate as alt
    from meshplan.planner.hetero.load_balance import Balance
    even, shares = (0.25,) * 4, (0.4, 0.3, 0.2, 0.1)
    answers = iter([shares, even, shares])
    monkeypatch.setattr(alt, "speed_shares", lambda types, dtype: even)
    monkeypatch.setattr(alt, "balance", lambda *a: Balance((next(answers),), 1.0))
    synthesized: list[object] = []
    real = alt.synthesize

    def counted(problem, **kw):   # type: ignore[no-untyped-def]
        synthesized.append(problem)
        return real(problem, **kw)

    monkeypatch.setattr(alt, "synthesize", counted)
    w = workload(MODELS["bert"])
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    found = alt.alternate(graph, four_speeds(), IntraOptions(), alt.StepSettings(), None, "fp32")
    assert [r.ratios for r in found.rounds] == [even, shares]
    assert len(synthesized) == 2
    assert found.ratios == shares   # the speed shares' program is the better of the two
    assert found.rounds[1].synthesized_s < found.rounds[0].synthesized_s


def test_auto_on_a_mixed_cluster_is_the_faster_of_hetero_and_uniform() -> None:
    auto = plan(MODELS["mlp"], four_speeds(), "auto")
    hetero = mixed_plan("four-speeds", "mlp", "hetero")
    steps = auto.options["mixed_auto"]["step_s"]
    assert steps["hetero"] == pytest.approx(hetero.predicted["step_time_s"])
    assert auto.predicted["step_time_s"] == pytest.approx(min(s for s in steps.values() if s))
    if auto.options["mixed_auto"]["chosen"] == "hetero":
        assert auto.method == "hetero" and auto.mesh_shape == (1, 4)
        assert auto.options["hetero"]["ratios"] == pytest.approx(
            hetero.options["hetero"]["ratios"])


def test_auto_on_a_mixed_cluster_searches_the_uneven_program_beside_the_pipelines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The uneven program is searched in a child at the idle priority while the uniform and
    typed-stage searches run here; the plan is the one searched in place."""
    import meshplan.api as api

    started: list[str] = []

    class Spy(api.Forked):
        def __init__(self, fn, priority: str = "nice") -> None:   # noqa: ANN001
            started.append(priority)
            super().__init__(fn, priority)

    monkeypatch.setattr(api, "Forked", Spy)
    scaled: list[meshplan.Plan] = []
    loss = api._microbatch_loss

    def scaling(found, *rest):   # noqa: ANN001, ANN002, ANN202
        scaled.append(found)
        return loss(found, *rest)

    monkeypatch.setattr(api, "_microbatch_loss", scaling)
    beside = plan(MODELS["mlp"], four_speeds(), "auto")
    assert started == ["idle"]
    # The loss scaling (a trace of the plan's micro-batch) of the plan returned only, not of
    # the uniform search's too.
    assert len(scaled) == 1 and scaled[0].predicted == beside.predicted
    monkeypatch.setattr(api, "forks", lambda: False)
    here = plan(MODELS["mlp"], four_speeds(), "auto")
    assert started == ["idle"]
    assert beside.options["mixed_auto"] == here.options["mixed_auto"]
    assert (beside.method, beside.mesh_shape, beside.predicted) == \
        (here.method, here.mesh_shape, here.predicted)


def test_auto_takes_a_2d_plan_where_it_is_faster() -> None:
    # VGG19's classifier on HAP's cluster: a 2-D mesh keeps its tensor parallelism inside the
    # PCIe hosts, which the one-row uneven program cannot (benchmarks/hetero_hap.py). The
    # typed stages (a pipeline, each stage on one host's type) beat the uniform 2-D plan by
    # about 5 % since clustering cuts where the fewest bytes cross (issue 25); auto takes
    # the fastest, never the one-row program here.
    spec = "vgg19:channels=8,fc=1024,batch=256"
    hosts = mixed_cluster("v100-p100-hosts", [[V100] * 4, [P100] * 4], link_preset("pcie3"),
                          Link(1.3e9, 50e-6))   # HAP's 10.4 Gb/s between hosts
    auto = plan(spec, hosts, "auto", dtype="fp32", microbatches=1)
    steps = auto.options["mixed_auto"]["step_s"]
    chosen = auto.options["mixed_auto"]["chosen"]
    assert chosen in ("uniform", "typed stages") and steps["uniform"] < steps["hetero"]
    assert steps[chosen] == min(s for s in steps.values() if s)
    assert auto.mesh_shape != (1, 8)


@pytest.mark.parametrize("spec", [
    "bert:hidden=256,layers=4,heads=4,seq=128,vocab=2048,batch=64",
    "vit:hidden=256,layers=4,heads=4,patch=4,image=32,classes=10,batch=64",
], ids=["bert", "vit"])
def test_haps_cluster_plans_in_seconds_and_beats_its_baselines(spec: str) -> None:
    p = plan(spec, HAP_CLUSTER, "hetero")
    h = p.options["hetero"]
    assert h["synthesis_s"] + h["balance_s"] < 10, h
    assert p.mesh_shape == (1, 64) and len(h["ratios"]) == 64
    assert sum(h["ratios"]) == pytest.approx(1.0)
    assert h["device_types"] == ["V100-SXM2-16GB"] * 16 + ["P100-SXM2-16GB"] * 48
    assert min(h["ratios"][:16]) > max(h["ratios"][16:])   # the faster devices take more
    for baseline in ("dp-proportional", "dp-even"):
        other = plan(spec, HAP_CLUSTER, baseline)
        assert p.predicted["step_time_s"] <= other.predicted["step_time_s"] * (1 + 1e-9)
        assert p.objective <= other.objective * (1 + 1e-9)


# -- refused requests -----------------------------------------------------------------------

TINY = MODELS["mlp"]


@pytest.mark.parametrize(("method", "kw", "match"), [
    ("hetero", {"mesh_shape": (2, 2)}, r"method 'hetero' plans every device as one row of the "
                                       r"mesh, \(1, n\).*give no mesh_shape"),
    ("dp-even", {"mesh_shape": (1, 4)}, r"method 'dp-even' plans every device.*no mesh_shape"),
    ("hetero", {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)},
     r"method 'hetero' prices compute and communication in seconds: give no alpha/beta"),
    ("dp-proportional", {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)}, r"give no alpha/beta"),
    ("hetero", {"axis_weights": ((1.0,), (1, 1, 1))},
     r"method 'hetero' takes axis_weights \(\(1.0,\), \(r_0, ..., r_3\)\): one non-negative "
     r"ratio per device of the \(1, 4\) mesh; got"),
    ("hetero", {"axis_weights": ((1.0,), (1, 1, -1, 1))}, r"one non-negative ratio per device"),
    ("hetero", {"axis_weights": ((1.0, 1.0), (1, 1, 1, 1))}, r"takes axis_weights \(\(1.0,\)"),
    ("dp-even", {"axis_weights": ((1.0,), (4, 3, 2, 1))},
     r"method 'dp-even' fixes its own shard ratios: give no axis_weights \(method 'hetero' "
     r"takes them\)"),
    ("dp-proportional", {"axis_weights": ((1.0,), (4, 3, 2, 1))}, r"give no axis_weights"),
    ("hetero", {"gather": "bogus"}, r"gather must be one of auto, padded, broadcast, got 'bogus'"),
    ("auto", {"gather": "ring"}, r"gather must be one of auto, padded, broadcast, got 'ring'"),
])
def test_requests_a_mixed_method_cannot_honour_are_refused(method: str, kw: dict,
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(TINY, four_speeds(), method, **kw)


@pytest.mark.parametrize("model", ["mlp", "moe"])
def test_the_simulator_prices_uneven_shards_as_the_planner_does(model: str) -> None:
    # A single-stage plan simulates to the planner's estimate; with uneven shards that holds
    # only if the simulator prices the gathers with the plan's ratios and gather choice.
    from meshplan.sim.simulate import simulate
    for gather in ("padded", "broadcast"):
        p = plan(MODELS[model], four_speeds(), "hetero", axis_weights=((1.0,), (4, 3, 2, 1)),
                 gather=gather)
        assert any(c.kind in ("all_gather", "reduce_scatter") for c in p.collectives)
        assert simulate(p).step_time_s == pytest.approx(p.predicted["step_time_s"], rel=1e-6)
