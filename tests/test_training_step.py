"""The training step of a single-stage plan: micro-batches with gradient accumulation, mixed
precision (autocast) and recomputation, each equal to single-device training."""

from __future__ import annotations

import copy
import functools
import math

import pytest

import meshplan.api as api

from meshplan.runtime.emulated import run_emulated
from meshplan.zoo.spec import Workload, build_workload
from meshplan.runtime.optim import OptimizerSpec
from oracle import (GPT, MLP, SGD, assert_matches, batches, plan_counter, reference,
                    train_rank)

WRN = "wresnet:layers=26,channels=4,width=1,image=8,classes=4,batch=8"
GPT8 = GPT.replace("batch=4", "batch=8")
SLOW_SGD = OptimizerSpec("sgd", lr=0.01)


def _opt(spec: str) -> OptimizerSpec:
    return SLOW_SGD if spec == WRN else SGD


@functools.cache
def _workload(spec: str) -> tuple[Workload, list]:
    """The workload and 3 batches; the Wide-ResNet in float64 (as in test_equivalence_zoo):
    batch norm over a few samples turns fp32 rounding into 1e-3 differences after one step.
    One per spec for the module: planning and training only read it, so meshplan's capture
    memo traces each model once per batch layout instead of once per case."""
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    if spec != WRN:
        return w, data
    (x,), t = w.example_batch
    return (Workload(copy.deepcopy(w.model).double(), w.loss_fn, ((x.double(),), t), w.name),
            [((x.double(),), t) for (x,), t in data])


@functools.cache
def _reference(spec: str, opt: OptimizerSpec, microbatches: int = 1, dtype: str = "fp32"
               ) -> tuple[list[float], dict]:
    """The single-device oracle on `_workload(spec)`, once per optimizer, micro-batch count
    and dtype."""
    w, data = _workload(spec)
    return reference(w, opt, data, microbatches=microbatches, dtype=dtype)


def _train(spec: str, shape: tuple[int, int], method: str, **step) -> tuple:
    w, data = _workload(spec)
    plan = api.plan(w.model, w.loss_fn, _opt(spec), w.example_batch, f"local:{math.prod(shape)}",
                    mesh_shape=shape, method=method, memory_budget_gb=0,
                    **({"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}),
                    **step)
    return plan, w, data, run_emulated(train_rank, shape, plan, w, data)


CASES = [(spec, shape, method, mb) for spec in (MLP, GPT8) for shape, method in
         (((1, 2), "data"), ((1, 4), "megatron"), ((2, 2), "auto")) for mb in (2, 4)]


@pytest.mark.parametrize("spec,shape,method,mb", CASES)
def test_microbatches_equal_one_full_batch_step(spec: str, shape, method: str, mb: int) -> None:
    # A mean loss over equal micro-batches, accumulated at 1/B each, is the full-batch mean:
    # the oracle trains the whole batch at once.
    plan, w, data, results = _train(spec, shape, method, microbatches=mb)
    assert plan.microbatches == mb
    ref = _reference(spec, SGD)
    for r in results:
        assert_matches(r, ref, plan, SGD)


@pytest.mark.parametrize("shape,method", [((1, 2), "data"), ((2, 2), "auto")])
def test_batch_norm_micro_batches_equal_accumulation_on_one_device(shape, method: str) -> None:
    # Batch norm normalizes each micro-batch by its own statistics, on one device as here:
    # the oracle is one device accumulating the same micro-batches.
    plan, w, data, results = _train(WRN, shape, method, microbatches=2)
    ref = _reference(WRN, SLOW_SGD, 2)
    for r in results:
        assert_matches(r, ref, plan, SLOW_SGD)


RECOMPUTE_CASES = [(spec, shape, method) for spec in (MLP, GPT8, WRN)
                   for shape, method in (((1, 2), "megatron"), ((2, 2), "auto"))] \
    + [(GPT8, (1, 2), "zero3")]


@pytest.mark.parametrize("spec,shape,method", RECOMPUTE_CASES)
def test_recomputation_equals_single_device(spec: str, shape, method: str) -> None:
    plan, w, data, results = _train(spec, shape, method, microbatches=2, recompute="full")
    assert plan.recompute
    forward = {(c.kind, c.bytes, c.mesh_axes): c.count for c in plan.collectives
               if c.phase == "forward"}
    again = {(c.kind, c.bytes, c.mesh_axes): c.count for c in plan.collectives
             if c.phase == "recompute"}
    # Every collective of the program's forward runs again, ZeRO-3's gathers included (the
    # replay gathers what backward needs, so backward gathers nothing again).
    assert again == forward
    if method == "zero3":
        assert not any(c.kind == "all_gather" and c.phase == "backward"
                       for c in plan.collectives)
    ref = _reference(spec, _opt(spec), 2)
    for r in results:
        assert_matches(r, ref, plan, _opt(spec))


# Unit roundoff of the half types: 8 and 11 significant bits.
ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
HALF_CASES = [(dtype, spec, shape, method) for dtype in ("bf16", "fp16") for spec in (MLP, GPT8)
              for shape, method in (((1, 2), "data"), ((1, 4), "megatron"), ((2, 2), "auto"))] \
    + [("bf16", GPT8, (1, 2), "zero3")]


@pytest.mark.parametrize("dtype,spec,shape,method", HALF_CASES)
def test_mixed_precision_equals_single_device_autocast(dtype: str, spec: str, shape,
                                                       method: str) -> None:
    """Against one device under the same autocast. Both round every matmul to the half type,
    but at different points (eager fuses the bias into its half-precision addmm, the plan adds
    it apart; a split contraction rounds each partial sum before reducing), so they differ by a
    few roundoffs u per value: losses within 4u, parameters within 32u of the update's norm
    (fp32 training itself is 2.5e-2 of the update away from bf16 autocast on the MLP). Each
    step's collectives are the plan's, sized at the dtypes autocast computes in (under ZeRO-3:
    backward gathers again the weights whose half-precision casts its matmuls saved)."""
    plan, w, data, results = _train(spec, shape, method, microbatches=2, dtype=dtype)
    assert plan.dtype == dtype
    losses, params = _reference(spec, SGD, 2, dtype)
    init = dict(w.model.named_parameters())
    u = ROUNDOFF[dtype]

    def norm(d: dict) -> float:
        return sum(v.double().pow(2).sum() for v in d.values()).sqrt().item()

    update = norm({k: params[k] - init[k].detach() for k in params})
    for got, got_params, per_step in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(got, losses)) <= 4 * u, (got, losses)
        assert norm({k: got_params[k] - params[k] for k in params}) <= 32 * u * update
        assert all(step == plan_counter(plan) for step in per_step)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_wide_resnet_runs_the_plans_collectives(dtype: str) -> None:
    """Convolutions run at the half type on every device (CPU autocast would leave the
    captured aten.convolution in fp32) and batch norm keeps its input's dtype, so each step's
    collectives are the plan's. (Numbers are not compared: batch norm over 4 samples makes
    fp32 training itself 45u from bf16 autocast on this network.)"""
    w = build_workload(WRN, device="cpu", seed=0)   # in float32, unlike `_workload`
    ops = []
    for shape, method in (((1, 2), "data"), ((2, 2), "auto")):
        plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, f"local:{math.prod(shape)}",
                        mesh_shape=shape, method=method, memory_budget_gb=0, microbatches=2,
                        dtype=dtype, **({"alpha": (1.0, 1.0), "beta": (1.0, 1.0)}
                                        if method == "auto" else {}))
        ops += plan.ops
        for _, _, per_step in run_emulated(train_rank, shape, plan, w, batches(w, 1)):
            assert per_step == [plan_counter(plan)]
    assert any(o.op == "conv" and "P" in o.output for o in ops)   # sums of half convs
    assert any(o.op == "batch_norm" and o.sync_axes for o in ops)   # float64 statistics


def test_a_split_off_bias_adds_at_the_half_type_as_eager_autocast_does() -> None:
    """A linear layer's and a convolution's bias, which the capture adds apart from the
    contraction, is added at the half type, as autocast's fused addmm and convolution add it:
    the layer's output is bf16 in the plan's cost graph and in the program that runs, where an
    fp32 add would double its activation and the kernels after it. An add the model writes
    itself after a matmul promotes to fp32 in all three, as eager's does."""
    import torch
    from torch import fx, nn
    from meshplan.capture.to_ir import capture
    from meshplan.cost.precision import with_compute_dtype
    from meshplan.lower.program import lower

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.conv = nn.Linear(8, 8), nn.Conv1d(8, 8, 1)
            self.w, self.b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))
            self.seen: list[torch.dtype] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h = self.conv(torch.relu(h).unsqueeze(-1))
            out = h.squeeze(-1) @ self.w + self.b
            self.seen = [t.dtype for t in (h, out)]   # eager's dtypes (fc's: below)
            return out

    torch.manual_seed(0)
    model, loss = Net(), nn.CrossEntropyLoss()
    x, t = torch.randn(6, 8), torch.randint(0, 4, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = [model.fc(x).dtype, *(model(x), model.seen)[1]]
    assert eager == [torch.bfloat16, torch.bfloat16, torch.float32]
    traced, graph = capture(model, loss, ((x,), t))
    adds = [n for n in graph.nodes if n.op == "add"]
    assert [n.half_bias for n in adds] == [True, True, False]
    costed = with_compute_dtype(graph, "bf16").by_name
    assert [costed[n.name].out.dtype for n in adds] == ["bfloat16", "bfloat16", "float32"]
    plan = api.plan(model, loss, SGD, ((x,), t), "local:1", mesh_shape=(1, 1), method="data",
                    dtype="bf16", memory_budget_gb=0)
    program = lower(traced, graph, plan, 0, plan.axis_weights)
    ran: dict[str, torch.dtype] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if program.owner.get(n.name) in {a.name for a in adds} and n.op != "placeholder" \
                    and "cast" not in n.name:
                ran[program.owner[n.name]] = out.dtype
            return out

    params = dict(model.named_parameters())
    args = [params[k] for role, k in program.placeholders if role == "param"] + [x, t]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Recorder(program.graph_module).run(None, None, *args)
    assert [ran[n.name] for n in adds] == eager


@pytest.mark.parametrize("recompute", [False, True])
def test_a_step_casts_each_parameter_to_the_half_type_once(monkeypatch, recompute: bool) -> None:
    """Four micro-batches at bf16: the first casts each parameter its matmuls read, the other
    three use those casts again (`runtime/step_casts.py`), recomputation's replays too, and
    the losses and parameters are bit for bit those of casting in every micro-batch."""
    from meshplan.runtime.step_casts import StepCasts
    w = build_workload(GPT8, device="cpu", seed=0)
    plan = api.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:1", mesh_shape=(1, 1),
                    method="data", dtype="bf16", microbatches=4, memory_budget_gb=0,
                    recompute="full" if recompute else "none")
    assert plan.recompute == recompute
    data = batches(w, 2)
    made, used = [], []
    kept = StepCasts.cast

    def counted(self: StepCasts, x, dtype):
        before = len(self._made)
        out = kept(self, x, dtype)
        if out is not None:
            (made if len(self._made) > before else used).append(out)
        return out

    monkeypatch.setattr(StepCasts, "cast", counted)
    [(losses, params, _)] = run_emulated(train_rank, (1, 1), plan, w, data)
    per_step = len(made) // 2
    assert per_step >= 8 and len(made) == 2 * per_step
    assert len(used) == 2 * per_step * (3 + 4 * recompute)   # 3 later micro-batches, 4 replays
    monkeypatch.setattr(StepCasts, "cast", lambda self, x, dtype: None)   # cast every time
    [(again, again_params, _)] = run_emulated(train_rank, (1, 1), plan, w, data)
    assert losses == again
    assert all(torch_equal(params[k], again_params[k]) for k in params)


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


def test_half_types_halve_activation_bytes_and_use_the_half_peak() -> None:
    import meshplan.api as api
    w = build_workload("gpt:hidden=2048,layers=2,heads=16,seq=512,vocab=1024,batch=8",
                       device="meta")
    plans = {dt: api.plan(w.model, w.loss_fn, SGD, w.example_batch, "dgx-a100:1",
                          mesh_shape=(1, 8), method="megatron", memory_budget_gb=0, dtype=dt)
             for dt in ("fp32", "bf16")}
    assert plans["bf16"].dtype == "bf16"
    # A matmul's output is half, so the all-reduces of the row-parallel matmuls' partial sums
    # halve; values autocast keeps in fp32 (the residual stream, its layer norms, their
    # gradients) keep their size.
    sums = {dt: sorted(b for c in p.collectives if (c.kind, c.phase) == ("all_reduce", "forward")
                       for b in [c.bytes] * c.count) for dt, p in plans.items()}
    assert len(sums["fp32"]) >= 4 and len(sums["bf16"]) >= 4
    assert sorted(set(sums["bf16"])) == sorted({b // 2 for b in sums["fp32"]})
    moved = {dt: sum(c.bytes * c.count for c in p.collectives) for dt, p in plans.items()}
    assert moved["fp32"] / 2 < moved["bf16"] < moved["fp32"]
    compute = {dt: sum(o.compute for o in p.ops if o.op == "mm") for dt, p in plans.items()}
    assert compute["bf16"] < compute["fp32"] / 8   # 312 vs 19.5 TFLOP/s peaks on an A100


def test_one_sample_per_rank_accumulates_each_gradient_once() -> None:
    """Regression: with one sample per rank, autograd handed the two batch-norm biases summed
    into a projection block's residual the same gradient tensor, and the next micro-batch
    accumulated into it twice (bias gradients g1 + 2 g2). Each parameter now owns its
    gradient. One step: batch norm over two samples makes gradients of ~100, so later steps
    amplify rounding chaotically."""
    spec = WRN.replace("batch=8", "batch=4")
    w0 = build_workload(spec, device="cpu", seed=0)
    (x,), t = w0.example_batch
    w = Workload(copy.deepcopy(w0.model).double(), w0.loss_fn, ((x.double(),), t), w0.name)
    data = [((x.double(),), t) for (x,), t in batches(w, 1)]
    plan = api.plan(w.model, w.loss_fn, SLOW_SGD, w.example_batch, "local:2", mesh_shape=(1, 2),
                    method="data", memory_budget_gb=0, microbatches=2)
    ref = reference(w, SLOW_SGD, data, microbatches=2)
    for r in run_emulated(train_rank, (1, 2), plan, w, data):
        assert_matches(r, ref, plan, SLOW_SGD)


@pytest.mark.parametrize("spec,shape,method", [(MLP, (1, 2), "data"), (GPT8, (1, 4), "megatron"),
                                               (GPT8, (2, 2), "zero3"), (MLP, (2, 2), "zero2")])
def test_global_norm_clipping_equals_single_device(spec: str, shape, method: str) -> None:
    """``max_grad_norm`` clips the global gradient norm as torch.nn.utils.clip_grad_norm_ does
    on one device, whatever the shards (tensor parallel pieces, ZeRO shards, replicas)."""
    clipped = OptimizerSpec("sgd", lr=0.1, max_grad_norm=0.05)   # below every step's norm
    w, data = _workload(spec)
    plan = api.plan(w.model, w.loss_fn, clipped, w.example_batch, f"local:{math.prod(shape)}",
                    mesh_shape=shape, method=method, memory_budget_gb=0, microbatches=2)
    ref = _reference(spec, clipped, 2)
    unclipped = _reference(spec, SGD, 2)
    assert ref[0][1:] != pytest.approx(unclipped[0][1:], rel=1e-3)   # clipping took effect
    for r in run_emulated(train_rank, shape, plan, w, data):
        assert_matches(r, ref, plan, clipped)


def test_bad_max_grad_norm_is_refused() -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        OptimizerSpec("sgd", max_grad_norm=0.0)
