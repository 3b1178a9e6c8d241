"""Golden planner cases from Alpa's test suite (shared/reference/alpa_cases.md, M1-M7, P1-P5).

Every case plans on an abstract mesh with alpha/beta cost units and compute left out, as Alpa's
tests do, and checks three things: the ILP objective (within 1 % of the table and to +-1 unit),
the decisions (parameter specs, update modes, how the batch is split) and the exact collective
list (kind, bytes, mesh axes, phase, count). The XLA toy ILP lives in tests/test_ilp.py.
"""

from __future__ import annotations

from typing import Callable

import pytest

import meshplan.api as api
from meshplan.api import method_options
from meshplan.capture.to_ir import capture
from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import LogicalMesh
from meshplan.ir.graph import Node
from meshplan.plan.plan import OpDecision, Plan
from meshplan.planner.intra.choices import Choice, IntraOptions, NodeChoices, resolve_choices
from meshplan.planner.intra.extract import extract
from meshplan.planner.intra.formulate import CostContext, Formulation, formulate
from meshplan.planner.intra.ilp import evaluate
from meshplan.runtime.optim import optimizer_spec
from meshplan.zoo.spec import build_workload

M1_MODEL = "mlp:layers=6,hidden=32,batch=256,bias=1"
M2_MODEL = "mlp:layers=6,hidden=256,batch=32,bias=1"
P_SMALL_H = "mlp:layers={layers},hidden=128,batch=1024,bias=0"
P_BIG_H = "mlp:layers={layers},hidden=1024,batch=128,bias=0"
MESHES_4 = [(4, 1), (1, 4)]
M3_BETA = (1.0, 0.1)
ALPA_M3 = 21_073.0

# Bytes of one fp32 step's parameters (the single gradient bucket of a data-parallel plan).
M1_PARAM_BYTES = 6 * (32 * 32 + 32) * 4       # 25,344
M2_PARAM_BYTES = 6 * (256 * 256 + 256) * 4    # 1,579,008
M1_NUMEL = M1_PARAM_BYTES // 4

Key = tuple[str, int, tuple[int, ...], str, int]


@pytest.fixture(scope="module")
def planned() -> Callable[..., Plan]:
    """Plan a zoo model on a 4- or 32-device abstract mesh; plans are cached per module."""
    cache: dict[tuple, Plan] = {}

    def run(spec: str, mesh: tuple[int, int], *, beta: tuple[float, float] = (1.0, 1.0),
            method: str = "auto", force_batch_dim: int | None = None,
            prefer_reduce_scatter: bool = False) -> Plan:
        key = (spec, mesh, beta, method, force_batch_dim, prefer_reduce_scatter)
        if key not in cache:
            w = build_workload(spec)
            cache[key] = api.plan(
                w.model, w.loss_fn, "adam", w.example_batch, f"local:{mesh[0] * mesh[1]}",
                mesh_shape=mesh, alpha=(1, 1), beta=beta, memory_budget_gb=0, method=method,
                force_batch_dim=force_batch_dim, prefer_reduce_scatter=prefer_reduce_scatter)
        return cache[key]

    return run


# ---------------------------------------------------------------- helpers

def active(mesh: tuple[int, int]) -> int:
    """The one mesh axis with more than one device on a (4,1) / (1,4) mesh."""
    return 0 if mesh[0] > 1 else 1


def collectives(plan: Plan) -> set[Key]:
    """The plan's collective list as (kind, bytes, mesh axes, phase, count) tuples."""
    return {(c.kind, c.bytes, c.mesh_axes, c.phase, c.count) for c in plan.collectives}


def assert_one_gradient_sync(plan: Plan, axes: tuple[int, ...]) -> None:
    """Alpa's one all-reduce of the whole gradient, as the runtime runs it: in the plan's
    buckets (a first of at most 1 MiB, overlapped with the backward), every parameter's
    gradient once."""
    assert collectives(plan) == {("all_reduce", b.bytes, axes, "update", 1) for b in plan.buckets}
    assert sum(b.bytes for b in plan.buckets) == M2_PARAM_BYTES
    assert plan.buckets[0].bytes <= 2 ** 20 and len(plan.buckets) == 2
    assert sorted(p for b in plan.buckets for p in b.params) == sorted(p.node for p in plan.params)


def assert_objective(plan: Plan, expected: float) -> None:
    """Within 1 % of the table, and to +-1 unit where the table rounds to whole units."""
    assert plan.objective == pytest.approx(expected, rel=0.01)
    assert plan.objective == pytest.approx(expected, abs=1.0)


def matmuls(plan: Plan) -> list[OpDecision]:
    """The plan's matmul decisions in graph order (one per Linear layer)."""
    return [o for o in plan.ops if o.op == "mm"]


def input_spec(plan: Plan, role: str = "input") -> str:
    """The sharding spec of the batch source with ``role`` (input or target)."""
    (src,) = [s for s in plan.sources if s.role == role]
    return src.spec


def assert_batch_split(plan: Plan, split: str, *, forced: bool) -> None:
    """The first matmul consumes the batch as ``split``; the input source is stored that way.

    Slicing a replicated input locally is free, so without an option forcing the batch split the
    ILP's objective ties between a split and a replicated source and either may come out; only
    plans whose options force the split must show it on the source itself.
    """
    assert matmuls(plan)[0].inputs[0] == split
    allowed = {split} if forced else {split, "R,R"}
    assert input_spec(plan) in allowed
    assert input_spec(plan, "target") in allowed


def assert_data_parallel(plan: Plan, axes: tuple[int, ...], *, update: str = "replicated",
                         sharded_storage: bool = False) -> None:
    """Every parameter computed replicated and synchronized over ``axes`` (stored split on dim 0
    over them under ZeRO-3); every matmul splits only the batch atom ``i`` over the mesh."""
    split = "S" + "".join(map(str, axes))
    for p in plan.params:
        ndim = p.spec.count(",") + 1
        assert p.spec == ",".join(["R"] * ndim), p
        want_storage = ",".join([split if sharded_storage else "R"] + ["R"] * (ndim - 1))
        assert (p.storage, p.update, p.sync_axes) == (want_storage, update, axes), p
    assert {o.strategy for o in matmuls(plan)} == {f"i:{split}"}


def assert_megatron(plan: Plan, axis: int, num_layers: int, *, bias: bool,
                    sync_axes: tuple[int, ...] = ()) -> None:
    """Odd layers (1-based) column-parallel on ``axis``, even ones row-parallel; column biases
    split, row biases replicated; parameters synchronized over ``sync_axes`` only."""
    s = f"S{axis}"
    want: dict[str, str] = {}
    for i in range(num_layers):
        column = i % 2 == 0
        want[f"layers.{i}.weight"] = f"{s},R" if column else f"R,{s}"
        if bias:
            want[f"layers.{i}.bias"] = s if column else "R"
    assert {p.name: p.spec for p in plan.params} == want
    for p in plan.params:
        assert (p.storage, p.update, p.sync_axes) == (p.spec, "replicated", sync_axes), p
    strategies = [o.strategy.split() for o in matmuls(plan)]
    assert [f"j:{s}" in st for st in strategies] == [i % 2 == 0 for i in range(num_layers)]
    assert [f"k:{s}" in st for st in strategies] == [i % 2 == 1 for i in range(num_layers)]


# ---------------------------------------------------------------- M1-M7

@pytest.mark.parametrize("mesh", MESHES_4)
def test_m1_pure_data_parallel(planned: Callable[..., Plan], mesh: tuple[int, int]) -> None:
    plan = planned(M1_MODEL, mesh)
    ax = active(mesh)
    assert_objective(plan, 38_028)
    assert len(plan.params) == 12
    assert_data_parallel(plan, (ax,))
    assert_batch_split(plan, f"S{ax},R", forced=False)
    assert collectives(plan) == {("all_reduce", M1_PARAM_BYTES, (ax,), "update", 1)}


@pytest.mark.parametrize("mesh", MESHES_4)
def test_m2_megatron(planned: Callable[..., Plan], mesh: tuple[int, int]) -> None:
    plan = planned(M2_MODEL, mesh)
    ax = active(mesh)
    assert_objective(plan, 245_765)
    assert_megatron(plan, ax, 6, bias=True)
    assert input_spec(plan) == "R,R"
    act = 32 * 256 * 4
    assert collectives(plan) == {("all_reduce", act, (ax,), "forward", 3),
                                 ("all_reduce", act, (ax,), "backward", 2)}


def test_m3_objective_not_above_alpa(planned: Callable[..., Plan]) -> None:
    """Known deviation: our optimum is 0.9 % below Alpa's plan (all layers column-parallel with
    all-gathered activations), so the check is one-sided plus the 1 % band."""
    plan = planned(M1_MODEL, (2, 2), beta=M3_BETA)
    assert plan.objective <= ALPA_M3
    assert plan.objective == pytest.approx(ALPA_M3, rel=0.01)


def test_m3_data_parallel_on_axis0(planned: Callable[..., Plan]) -> None:
    plan = planned(M1_MODEL, (2, 2), beta=M3_BETA)
    assert_batch_split(plan, "S0,R", forced=False)
    for p in plan.params:
        assert "0" not in p.spec and "0" not in p.storage, p
        assert (p.update, p.sync_axes) == ("replicated", (0,)), p
    on_axis0 = {c for c in collectives(plan) if 0 in c[2]}
    assert {(kind, phase, count) for kind, _, _, phase, count in on_axis0} == {
        ("all_reduce", "update", 1)}


def _m3_formulation() -> Formulation:
    """M3's ILP built the way `api.plan` builds it (auto method, abstract units, no budget)."""
    w = build_workload(M1_MODEL)
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    opts = IntraOptions(**method_options("auto"), memory_budget=None, include_compute=False,
                        optimizer="adam")
    nc = resolve_choices(graph, (2, 2), opts)
    ctx = CostContext(LogicalMesh((2, 2), (1.0, 1.0), M3_BETA), None,
                      optimizer_spec("adam").state())
    return formulate(nc, ctx, None)


def _choice_key(node: Node, choice: Choice) -> tuple:
    """What identifies a root's choice: a matmul's operand layouts, a source's layout and mode."""
    if node.is_source:
        return (choice.strategy.output.spec(), choice.mode)
    return tuple(lay.spec() for lay in choice.strategy.inputs)


def _alpa_m3_keys(nc: NodeChoices) -> dict[str, tuple]:
    """Alpa's M3 plan as a choice key per root: batch on axis 0; layers 1, 3, 5 column-parallel
    on axis 1 (weight S1,R, bias S1; activation in S0,R, W^T in R,S1), layers 2, 4, 6
    row-parallel (weight R,S1, bias R; activation in S0,S1, W^T in S1,R)."""
    want: dict[str, tuple] = {}
    mms = [n.name for n in nc.graph.nodes if n.op == "mm"]
    for i, name in enumerate(mms):
        want[name] = ("S0,R", "R,S1") if i % 2 == 0 else ("S0,S1", "S1,R")
    for n in nc.graph.nodes:
        if n.role in ("input", "target"):
            want[n.name] = ("S0,R", None)
        elif n.role == "param":
            _, layer, kind = n.state_name.split(".")
            column = int(layer) % 2 == 0
            spec = {"weight": "S1,R" if column else "R,S1", "bias": "S1" if column else "R"}
            want[n.name] = (spec[kind], "replicated")
    return want


def _alpa_m3_choices(form: Formulation) -> tuple[int, ...]:
    """Alpa's M3 plan as one choice index per root of ``form`` (followers follow)."""
    nc = form.choices
    want = _alpa_m3_keys(nc)
    assert set(want) == set(form.roots), "M3 has roots outside params, sources and matmuls"
    out = []
    for r in form.roots:
        node = nc.graph.by_name[r]
        hits = [p for p, c in enumerate(nc.choices[r]) if _choice_key(node, c) == want[r]]
        assert len(hits) == 1, (r, want[r], hits)
        out.append(hits[0])
    return tuple(out)


def test_m3_alpa_plan_costs_21073_under_our_model() -> None:
    form = _m3_formulation()
    choices = _alpa_m3_choices(form)
    node_cost, edge_cost = evaluate(form.problem, choices)
    assert node_cost + edge_cost == pytest.approx(ALPA_M3, abs=1.0)
    # Its collectives are the table's: 5 activation all-reduces on axis 1, one gradient bucket
    # on axis 0 (6 weights split in half, 3 split biases, 3 replicated biases).
    result = extract(form, choices, form.ctx)
    act = 256 * 32 * 4 // 2
    bucket = 6 * 32 * 32 * 4 // 2 + 3 * 32 * 4 // 2 + 3 * 32 * 4
    assert {(c.kind, c.bytes, c.mesh_axes, c.phase, c.count) for c in result.collectives} == {
        ("all_reduce", act, (1,), "forward", 3), ("all_reduce", act, (1,), "backward", 2),
        ("all_reduce", bucket, (0,), "update", 1)}


@pytest.mark.parametrize("mesh", MESHES_4)
def test_m4_forced_data_parallel(planned: Callable[..., Plan], mesh: tuple[int, int]) -> None:
    plan = planned(M2_MODEL, mesh, method="data")
    ax = active(mesh)
    assert_objective(plan, 2_368_524)
    assert_data_parallel(plan, (ax,))
    assert_batch_split(plan, f"S{ax},R", forced=True)
    assert_one_gradient_sync(plan, (ax,))


def test_m5_batch_on_axis0_of_4x1_is_data_parallel(planned: Callable[..., Plan]) -> None:
    plan = planned(M2_MODEL, (4, 1), force_batch_dim=0)
    assert_objective(plan, 2_368_524)
    assert_data_parallel(plan, (0,))
    assert_batch_split(plan, "S0,R", forced=True)
    assert_one_gradient_sync(plan, (0,))


def test_m5_batch_on_size1_axis_leaves_megatron(planned: Callable[..., Plan]) -> None:
    plan = planned(M2_MODEL, (1, 4), force_batch_dim=0)
    assert_objective(plan, 245_765)
    assert_megatron(plan, 1, 6, bias=True)
    act = 32 * 256 * 4
    assert collectives(plan) == {("all_reduce", act, (1,), "forward", 3),
                                 ("all_reduce", act, (1,), "backward", 2)}


@pytest.mark.parametrize("mesh", MESHES_4)
def test_m6_prefer_reduce_scatter_is_zero2(planned: Callable[..., Plan],
                                           mesh: tuple[int, int]) -> None:
    """Alpa's objective; each gradient is reduce-scattered in backward as soon as it is
    complete (the whole gradient never outlives its reduce-scatter), the updated shards are
    gathered a bucket of at most the largest parameter at a time: weight and bias apart."""
    plan = planned(M1_MODEL, mesh, prefer_reduce_scatter=True)
    ax = active(mesh)
    assert_objective(plan, 38_040)
    assert_data_parallel(plan, (ax,), update="zero2")
    assert_batch_split(plan, f"S{ax},R", forced=False)
    assert collectives(plan) == {("reduce_scatter", 32 * 32 * 4, (ax,), "backward", 6),
                                 ("reduce_scatter", 32 * 4, (ax,), "backward", 6),
                                 ("all_gather", 32 * 32 * 4, (ax,), "update", 6),
                                 ("all_gather", 32 * 4, (ax,), "update", 6)}


@pytest.mark.parametrize("mesh", MESHES_4)
def test_m7_zero3(planned: Callable[..., Plan], mesh: tuple[int, int]) -> None:
    """Alpa's table prices ZeRO-3 as one reduce-scatter and one all-gather per parameter
    (38,040). meshplan's runtime gathers each parameter where it is used and frees it, so a
    weight that backward needs is gathered again there — five of the six matmuls' (the first
    layer's input needs no gradient, so autograd keeps no weight there; biases are never
    kept): the objective is Alpa's plus those five all-gathers, and each gradient is
    reduce-scattered in backward as soon as it is complete. The runtime moves each layer's
    weight and bias as one unit (one collective each time), which the objective, pricing every
    parameter alone, counts as two."""
    plan = planned(M1_MODEL, mesh, method="zero3")
    ax = active(mesh)
    again = 5 * collective_cost("all_gather", LogicalMesh(mesh, (1.0, 1.0), (1.0, 1.0)), (ax,),
                                32 * 32 * 4)
    assert_objective(plan, 38_040 + again)
    assert_data_parallel(plan, (ax,), update="zero3", sharded_storage=True)
    assert_batch_split(plan, f"S{ax},R", forced=True)
    layer = 32 * 32 * 4 + 32 * 4
    assert [len(u.params) for u in plan.units] == [2] * 6
    assert collectives(plan) == {("all_gather", layer, (ax,), "forward", 6),
                                 ("all_gather", layer, (ax,), "backward", 5),
                                 ("reduce_scatter", layer, (ax,), "backward", 6)}


@pytest.mark.parametrize("method,sharded_bytes_per_elem", [("zero2", 4 + 8), ("zero3", 4 + 4 + 8)])
def test_zero_shards_optimizer_state_4way(planned: Callable[..., Plan], method: str,
                                          sharded_bytes_per_elem: int) -> None:
    """ZeRO keeps 1/4 of the gradient and Adam moments (and, for ZeRO-3, of the parameters) per
    device: the predicted peak drops by 3/4 of those bytes against forced data parallelism
    (both methods force the batch split, so activations are equal), less, for ZeRO-3, its
    working set: the largest weight's whole gradient until its reduce-scatter, and for ZeRO-3
    the weight whole too."""
    base = planned(M1_MODEL, (4, 1), method="data").predicted["peak_memory_bytes"]
    zero = planned(M1_MODEL, (4, 1), method=method).predicted["peak_memory_bytes"]
    working = (2 if method == "zero3" else 1) * 32 * 32 * 4
    assert base - zero == pytest.approx(M1_NUMEL * sharded_bytes_per_elem * 3 / 4 - working)


# ---------------------------------------------------------------- P1-P5

@pytest.mark.parametrize("mesh", MESHES_4)
@pytest.mark.parametrize("layers,expected", [(2, 196_610), (12, 1_179_660)])
def test_p1_p3_small_hidden_is_data_parallel(planned: Callable[..., Plan], mesh: tuple[int, int],
                                             layers: int, expected: float) -> None:
    plan = planned(P_SMALL_H.format(layers=layers), mesh)
    ax = active(mesh)
    assert_objective(plan, expected)
    assert_data_parallel(plan, (ax,))
    assert_batch_split(plan, f"S{ax},R", forced=False)
    assert collectives(plan) == {("all_reduce", layers * 128 * 128 * 4, (ax,), "update", 1)}


@pytest.mark.parametrize("mesh", MESHES_4)
@pytest.mark.parametrize("layers,expected", [(2, 786_433), (12, 8_650_763)])
def test_p2_p4_big_hidden_is_megatron(planned: Callable[..., Plan], mesh: tuple[int, int],
                                      layers: int, expected: float) -> None:
    plan = planned(P_BIG_H.format(layers=layers), mesh)
    ax = active(mesh)
    assert_objective(plan, expected)
    assert_megatron(plan, ax, layers, bias=False)
    assert input_spec(plan) == "R,R"
    act = 128 * 1024 * 4
    want = {("all_reduce", act, (ax,), "forward", layers // 2)}
    if layers > 2:
        want.add(("all_reduce", act, (ax,), "backward", layers // 2 - 1))
    assert collectives(plan) == want


@pytest.mark.parametrize("mesh,expected", [((4, 8), 26_873), ((8, 4), 58_330)])
def test_p5_data_parallel_axis0_megatron_axis1(planned: Callable[..., Plan],
                                               mesh: tuple[int, int], expected: float) -> None:
    plan = planned(P_SMALL_H.format(layers=2), mesh, beta=(1.0, 0.01))
    m0, m1 = mesh
    assert_objective(plan, expected)
    assert_megatron(plan, 1, 2, bias=False, sync_axes=(0,))
    assert_batch_split(plan, "S0,R", forced=False)
    assert [o.strategy for o in matmuls(plan)] == ["i:S0 j:S1", "i:S0 k:S1"]
    assert collectives(plan) == {("all_reduce", 2 * 128 * 128 * 4 // m1, (0,), "update", 1),
                                 ("all_reduce", 1024 * 128 * 4 // m0, (1,), "forward", 1)}
