"""torch's GradScaler in the user's loop (`parallelize`): ``scaler.unscale_`` sees the step's
synchronized gradients, as one device's are complete after backward, and every rank finds an
inf alike, so every rank skips a step and lowers its scale as one device does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
import meshplan.api as api
from meshplan.runtime.emulated import run_emulated, run_emulated_stages

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4))


def _data() -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 16, generator=g),), torch.randn(8, 4, generator=g))
            for _ in range(STEPS)]


def _loop(model, opt, call, data: list, init_scale: float) -> list[tuple[float, float, float]]:
    """The AMP loop of PyTorch's recipe: scale, backward, unscale, clip, step, update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    out = []
    for batch in data:
        loss = call(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = model.clip_grad_norm_(0.5) if hasattr(model, "_unscaled") else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((loss.item(), float(norm), scaler.get_scale()))
    return out


def _one_device(data: list, init_scale: float) -> list:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def call(batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(model(*batch[0]), batch[1])
    return _loop(model, opt, call, data, init_scale)


def _parallel(plan: meshplan.Plan, data: list, init_scale: float) -> list:
    start = _model()   # built once: the ranks are threads sharing the global generator

    def rank(comm, p2p=None):
        model = copy.deepcopy(start)
        model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          plan, F.mse_loss, comm=comm, p2p=p2p)
        return _loop(model, opt, model, data, init_scale)
    if plan.num_stages > 1:
        return run_emulated_stages(rank, plan.stage_meshes())
    return run_emulated(rank, plan.mesh_shape)


@pytest.mark.parametrize("method,mesh,microbatches,init_scale", [
    ("data", (1, 2), 1, 1e9),            # every step overflows: skipped, the scale halved
    ("zero2", (1, 2), 1, 1e9),           # each rank checks only its shards
    ("zero3", (2, 2), 1, 2.0 ** 26),     # overflows, then steps once the scale is low enough
    ("zero2", (1, 2), 2, 1024.0),        # the scale taken at synchronization
    ("megatron:dp=1,tp=1,pp=2", None, 2, 1024.0),
])
def test_grad_scaler_steps_and_skips_as_one_device(method, mesh, microbatches, init_scale):
    data = _data()
    kw = {} if mesh is None else dict(mesh_shape=mesh)
    devices = 2 if mesh is None else mesh[0] * mesh[1]
    plan = api.plan(_model(), F.mse_loss, "sgd", data[0], f"local:{devices}", method=method,
                    microbatches=microbatches, dtype="fp16", memory_budget_gb=0, **kw)
    ref = _one_device(data, init_scale)
    for got in _parallel(plan, data, init_scale):
        assert [s for _, _, s in got] == [s for _, _, s in ref]   # same skips, same scales
        for (loss, norm, _), (ref_loss, ref_norm, _) in zip(got, ref):
            assert loss == pytest.approx(ref_loss, rel=2e-3)
            assert norm == pytest.approx(ref_norm, rel=2e-3, nan_ok=True)


def _tiny_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) * 2.0 ** -22   # its fp16 gradients underflow unscaled


def _norms_after_a_step(model, opt, call, data: list) -> list[float]:
    """The AMP loop at a fixed scale; the first step at learning rate 0 (the backward inside
    a plan's call has no scale of the loop's to run at before it), the norms of the next."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6)
    norms = []
    for i, batch in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = 0.0 if i == 0 else 0.1
        scaler.scale(call(batch)).backward()
        scaler.unscale_(opt)
        norms.append(float(model.clip_grad_norm_(1e9) if hasattr(model, "_unscaled") else
                           torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return norms[1:]


@pytest.mark.parametrize("method,mesh", [("zero2", (1, 2)), ("megatron:dp=1,tp=1,pp=2", None)])
def test_backward_inside_the_call_runs_at_the_loops_scale(method, mesh):
    """A plan's micro-batches and pipeline schedule run backward inside the call, before the
    loop's ``scaler.scale(loss).backward()`` gives the scale: they run at the last step's, so
    half-precision gradients too small unscaled survive as on one device."""
    data = _data()[:3]
    start = _model()
    one = copy.deepcopy(start)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)

    def call(batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return _tiny_loss(one(*batch[0]), batch[1])
    ref = _norms_after_a_step(one, opt, call, data)
    kw = {} if mesh is None else dict(mesh_shape=mesh)
    plan = api.plan(start, _tiny_loss, "sgd", data[0], "local:2", method=method,
                    microbatches=2, dtype="fp16", memory_budget_gb=0, **kw)

    def rank(comm, p2p=None):
        model = copy.deepcopy(start)
        model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          plan, _tiny_loss, comm=comm, p2p=p2p)
        return _norms_after_a_step(model, opt, model, data)
    runs = run_emulated_stages(rank, plan.stage_meshes()) if plan.num_stages > 1 else \
        run_emulated(rank, plan.mesh_shape)
    for norms in runs:
        assert norms == pytest.approx(ref, rel=2e-3)
