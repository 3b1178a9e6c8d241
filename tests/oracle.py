"""The single-device oracle and helpers shared by the equivalence tests.

Every parallel run starts from the state of the same seeded model the oracle trains; each rank
keeps its shards of it. Losses of every step and final parameters are compared with
single-device training, and the collectives the runtime recorded with the plan's own list.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any

import torch

import meshplan.api as api
from meshplan.capture.batch import flatten_batch, split_microbatches, step_loss
from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import LogicalMesh
from meshplan.capture.to_ir import capture
from meshplan.plan.plan import Plan
from meshplan.runtime.comm import Comm
from meshplan.runtime.optim import OptimizerSpec, make_optimizer
from meshplan.runtime.step_modes import autocast_for
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import Workload, build_workload

SGD = OptimizerSpec("sgd", lr=0.1)
ADAMW = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.01)
MLP = "mlp:layers=4,hidden=16,batch=8,bias=1"
GPT = "gpt:hidden=32,layers=2,heads=4,seq=8,vocab=64,batch=4"


def batches(w: Workload, n: int, seed: int = 5) -> list[Any]:
    """``n`` random global batches shaped like the workload's example batch."""
    g = torch.Generator().manual_seed(seed)
    (x,), t = w.example_batch

    def like(a: torch.Tensor) -> torch.Tensor:
        if a.is_floating_point():
            return torch.randn(a.shape, generator=g)
        return torch.randint(0, int(a.max()) + 1, a.shape, generator=g)  # labels stay valid

    return [((like(x),), like(t)) for _ in range(n)]


def reference(w: Workload, opt: OptimizerSpec, data: list[Any], *, microbatches: int = 1,
              dtype: str = "fp32") -> tuple[list[float], dict]:
    """Single-device training: the oracle. Step i runs after ``torch.manual_seed(i)``, the seed
    the Trainer gives step i's dropout; with ``microbatches`` > 1 it accumulates gradients over
    equal cuts of the batch (loss 1/B each), under autocast at ``dtype``."""
    model = copy.deepcopy(w.model)
    o = make_optimizer(opt, model.parameters())
    losses = []
    for step, batch in enumerate(data):
        torch.manual_seed(step)
        total = 0.0
        for piece in split_microbatches(batch, microbatches):
            layout, tensors = flatten_batch(piece)
            args, kwargs, target = layout.call(list(tensors.values()))
            with autocast_for(dtype):
                loss = step_loss(w.loss_fn, model(*args, **kwargs), target)
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        if opt.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.max_grad_norm)
        o.step()
        o.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


@functools.cache
def meta_workload(spec: str) -> Workload:
    """One meta model per zoo spec for the session: every plan of it reuses meshplan's capture
    (`capture/memo.py` keys captures by model object). The planner only reads it."""
    return build_workload(spec, device="meta")


@functools.cache
def seeded_run(spec: str, opt: OptimizerSpec, steps: int = 3
               ) -> tuple[Workload, list[Any], tuple[list[float], dict]]:
    """The seeded CPU workload of ``spec``, ``steps`` batches and the oracle's result on them,
    made once per session: training reads the workload, never changes it (a run that did would
    no longer match the oracle computed from it)."""
    w = cpu_workload(spec)
    data = batches(w, steps)
    return w, data, reference(w, opt, data)


@functools.cache
def cpu_workload(spec: str) -> Workload:
    """The seeded CPU workload of ``spec``, one per session (see `seeded_run`)."""
    return build_workload(spec, device="cpu", seed=0)


@functools.cache
def cpu_capture(spec: str, microbatches: int = 1) -> Any:
    """The capture of `cpu_workload(spec)` at one of ``microbatches`` micro-batches (a plan's
    program), traced once per process: a pool's rank reuses it in every test after the first
    (each run's model a new object, which meshplan's per-model memo would trace again). Not
    handed over from the test process: a pickled GraphModule is rebuilt from its code, its
    nodes renamed and their marks (`HALF_BIAS`) lost."""
    w = cpu_workload(spec)
    return capture(w.model, w.loss_fn, split_microbatches(w.example_batch, microbatches)[0])


def make_plan(spec: str, shape: tuple[int, int], method: str, opt: OptimizerSpec, *,
              abstract: bool = False, **kw: Any) -> Plan:
    w = meta_workload(spec)
    extra = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if abstract else {}
    return api.plan(w.model, w.loss_fn, opt, w.example_batch, f"local:{shape[0] * shape[1]}",
                    mesh_shape=shape, method=method, memory_budget_gb=0, name=spec, **extra, **kw)


# The update-phase collectives of each mode (bucketed by the runtime; ZeRO's reduce-scatters
# and ZeRO-3's gathers run per parameter in the passes, listed one by one).
UPDATE_KINDS = {"replicated": ("all_reduce",), "zero2": ("all_gather",), "zero3": ()}


def alpha_beta_sum(plan: Plan) -> float:
    """The α-β cost of the plan's collectives as the ILP charges them: the runtime buckets the
    update-phase synchronizations of all parameters into one collective per kind and axes, which
    the ILP, pricing each parameter alone, counts as one latency per parameter."""
    mesh = LogicalMesh(plan.mesh_shape, plan.alpha, plan.beta)
    listed = sum(c.count * collective_cost(c.kind, mesh, c.mesh_axes, c.bytes)
                 for c in plan.collectives)
    per_param = sum(collective_cost(kind, mesh, p.sync_axes, 0)
                    for p in plan.params if p.sync_axes for kind in UPDATE_KINDS[p.update])
    bucketed = sum(c.count * collective_cost(c.kind, mesh, c.mesh_axes, 0)
                   for c in plan.collectives if c.phase == "update")
    return listed + per_param - bucketed


def record_counter(records: list) -> Counter:
    return Counter((r.kind, r.nbytes, tuple(r.axes), r.phase) for r in records)


def plan_counter(plan: Plan) -> Counter:
    out: Counter = Counter()   # entries of different model segments add up
    for c in plan.collectives:
        out[(c.kind, c.bytes, tuple(c.mesh_axes), c.phase)] += c.count
    return out


def train_rank(comm: Comm, plan: Plan, w: Workload, data: list[Any], captured: Any = None
               ) -> tuple[list[float], dict, list[Counter]]:
    """Run on one rank; returns losses, gathered parameters and per-step collective records."""
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    losses, per_step = [], []
    for b in data:
        start = len(comm.records)
        losses.append(tr.step(b))
        per_step.append(record_counter(comm.records[start:]))
    return losses, tr.full_state_dict(), per_step


def shared_capture(w: Workload) -> Any:
    return capture(w.model, w.loss_fn, w.example_batch)


def assert_matches(result: tuple, ref: tuple, plan: Plan, opt: OptimizerSpec,
                   tol: float | None = None) -> None:
    """Losses and parameters equal the oracle's; each step's collectives equal the plan's.
    Default tolerance: 1e-5 relative with SGD, 1e-4 norm-wise with Adam(W)."""
    losses, params, per_step = result
    ref_losses, ref_params = ref
    tol = tol if tol is not None else 1e-5 if opt.kind == "sgd" else 1e-4
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=0), \
        (losses, ref_losses)
    # A tensor that stays ~0 in exact arithmetic (a key bias: softmax is shift-invariant) is
    # compared against a floor of a thousandth of the model's largest parameter, not its own size.
    floor = 1e-3 * max([r.abs().max().item() for r in ref_params.values() if r.numel()] or [0.0])
    for name, r in ref_params.items():
        assert params[name].shape == r.shape, name
        if opt.kind == "sgd":
            if not r.numel():
                continue
            err, scale = (params[name] - r).abs().max().item(), r.abs().max().item()
            assert err <= tol * max(scale, floor), f"{name}: error {err:.3g} > {tol} x {scale:.3g}"
    if opt.kind != "sgd":
        # Adam divides each gradient by its own magnitude, so a gradient that is zero in exact
        # arithmetic (attention's key bias: softmax is shift-invariant) turns sum-order noise
        # into full-size steps; Adam is therefore checked norm-wise over the whole model.
        diff = sum((params[k] - r).pow(2).sum() for k, r in ref_params.items()).sqrt().item()
        scale = sum(r.pow(2).sum() for r in ref_params.values()).sqrt().item()
        assert diff <= tol * scale, f"parameters differ by {diff:.3g} > {tol} x {scale:.3g}"
    expected = plan_counter(plan)
    for step, got in enumerate(per_step):
        assert got == expected, f"step {step}: recorded {dict(got)} != planned {dict(expected)}"


def trained_states(plan: Plan, model: torch.nn.Module, loss_fn: Any, data: list[Any]
                   ) -> list[tuple[list[float], dict]]:
    """Training ``plan`` of the test's own ``model`` on emulated ranks over ``data`` (global
    batches; the first is the example): per rank its losses and whole state (parameters and
    buffers); a pipeline's as one, its stages' states merged."""
    from meshplan.runtime.emulated import run_emulated, run_emulated_stages
    from meshplan.runtime.pipeline import PipelineTrainer
    if plan.num_stages == 1:
        def rank(comm: Comm) -> tuple[list[float], dict]:
            tr = Trainer(plan, model, loss_fn, data[0], comm)
            return [tr.step(b) for b in data], tr.full_state_dict()
        return run_emulated(rank, plan.mesh_shape)
    captured = capture(model, loss_fn, split_microbatches(data[0], plan.microbatches)[0])

    def stage_rank(comm: Comm, p2p: Any) -> tuple[list[float], dict]:
        tr = PipelineTrainer(plan, model, loss_fn, data[0], comm, p2p, captured=captured)
        return [tr.step(b, seed=i) for i, b in enumerate(data)], tr.full_state_dict()

    results = run_emulated_stages(stage_rank, plan.stage_meshes())
    state: dict = {}
    for _, s in results:
        state.update(s)
    return [(results[0][0], state)]


def plain_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                   data: list[Any], microbatches: int = 1) -> tuple[list[float], dict]:
    """One device's loop over ``data`` (``((x,), target)`` batches): each batch's gradients
    accumulated over ``microbatches`` equal cuts (each loss divided by their number), then
    one step; the losses and the final state (buffers included)."""
    losses = []
    for (x,), t in data:
        total = 0.0
        for xm, tm in zip(x.chunk(microbatches), t.chunk(microbatches)):
            loss = loss_fn(model(xm), tm)
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
