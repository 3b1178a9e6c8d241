"""``model.eval()`` in the user's loop under ``meshplan.parallelize``: a validation pass between
training steps gives the loss one device's model gives in evaluation mode (dropout off, batch
norm on its running statistics, neither updated), and training goes on as if it had not run.
Before, the parallel model ran its training program in evaluation mode too: dropout masks
drawn, batch statistics used and the running ones updated, silently; and a first call under
``torch.no_grad()`` traced a program without gradients and was refused as another model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import meshplan
from meshplan.runtime.emulated import run_emulated, run_emulated_stages
from meshplan.zoo.spec import build_workload
from oracle import batches


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))


LOSS = nn.CrossEntropyLoss()


def _data(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 8, generator=g),), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _loop(model, opt, train: list, held_out: list, step) -> tuple[list, list]:
    """Evaluate first (before any step), then train a step and evaluate, twice. ``step(i,
    batch)``: step i's training loss (one device seeds its dropout as the runtime does)."""
    def evaluate() -> list[float]:
        model.eval()
        with torch.no_grad():
            out = [float(step(None, b)) for b in held_out]
        model.train()
        return out

    evals, losses = [evaluate()], []
    for i, batch in enumerate(train):
        loss = step(i, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        evals.append(evaluate())
    return losses, evals


def _one_device(model: nn.Module, loss_fn, train: list, held_out: list) -> tuple:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i, batch):
        if i is not None:
            torch.manual_seed(i)
        (x,), t = batch
        return loss_fn(model(x), t)
    losses, evals = _loop(model, opt, train, held_out, step)
    return losses, evals, {n: p.detach() for n, p in model.named_parameters()}


def _rank(comm, plan, model, loss_fn, train, held_out, p2p=None) -> tuple:
    mine = copy.deepcopy(model)
    par, opt = meshplan.parallelize(mine, torch.optim.SGD(mine.parameters(), lr=0.1), plan,
                                    loss_fn, comm=comm, p2p=p2p)
    losses, evals = _loop(par, opt, train, held_out, lambda i, b: par(b))
    par.eval()   # once more, to see how it evaluates: a whole copy, or the plan's program
    with torch.no_grad():
        par(held_out[0])
    copied = par._eval_model is not None
    par.train()
    return losses, evals, par.full_state_dict(), copied


def _stage(comm, p2p, plan, model, loss_fn, train, held_out) -> tuple:
    return _rank(comm, plan, model, loss_fn, train, held_out, p2p)


def _plan(model, loss_fn, batch, cluster: str, **kw) -> meshplan.Plan:
    return meshplan.plan(model, loss_fn, "sgd", batch, cluster, memory_budget_gb=0,
                         dtype="fp32", **kw)


@pytest.mark.parametrize("shape, method", [((1, 2), "data"), ((2, 2), "intra-only"),
                                           ((1, 4), "zero3")])
def test_evaluation_between_steps_gives_one_devices_eval_loss(shape, method) -> None:
    """Dropout and batch norm: the whole model, gathered, evaluates on each rank."""
    model, train, held_out = _net(), _data(2), _data(3)[1:]
    ref_losses, ref_evals, ref_params = _one_device(model, LOSS, train, held_out)
    plan = _plan(model, LOSS, train[0], f"local:{shape[0] * shape[1]}", mesh_shape=shape,
                 method=method)
    for losses, evals, params, copied in run_emulated(_rank, plan.mesh_shape, plan, model, LOSS,
                                                      train, held_out):
        assert copied
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert sum(evals, []) == pytest.approx(sum(ref_evals, []), rel=1e-5)
        for name, value in ref_params.items():   # evaluation moved no running statistic
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
    # Evaluation differs from training here: a plan running its training program would not
    # have matched (dropout, batch statistics).
    assert ref_evals[0] != pytest.approx(_training_mode_losses(model, held_out), rel=1e-3)


def _training_mode_losses(model: nn.Module, held_out: list) -> list[float]:
    model = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        return [LOSS(model(x), t).item() for (x,), t in held_out]


GPT = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"


def test_a_model_alike_in_evaluation_is_evaluated_by_the_plans_own_program() -> None:
    """No dropout, no batch norm: evaluation mode is the same program, run sharded by the
    plan (no whole copy), on one stage and across a pipeline's."""
    w = build_workload(GPT, device="cpu", seed=0)
    train, held_out = batches(w, 2), batches(w, 4)[2:]
    ref_losses, ref_evals, _ = _one_device(w.model, w.loss_fn, train, held_out)
    one = _plan(w.model, w.loss_fn, w.example_batch, "local:2", mesh_shape=(1, 2),
                method="intra-only")
    for losses, evals, _, copied in run_emulated(_rank, one.mesh_shape, one, w.model,
                                                 w.loss_fn, train, held_out):
        assert not copied
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert sum(evals, []) == pytest.approx(sum(ref_evals, []), rel=1e-5)
    piped = _plan(w.model, w.loss_fn, w.example_batch, "local:2",
                  method="megatron:dp=1,tp=1,pp=2", microbatches=2)
    for losses, evals, _, copied in run_emulated_stages(_stage, piped.stage_meshes(), piped,
                                                        w.model, w.loss_fn, train, held_out):
        assert not copied
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert sum(evals, []) == pytest.approx(sum(ref_evals, []), rel=1e-5)


def test_a_pipeline_of_a_model_unlike_in_evaluation_evaluates_the_whole_model() -> None:
    """Dropout and batch norm across two stages: each stage's parameters and buffers sent to
    every rank, the whole model evaluated there."""
    model, train, held_out = _net(), _data(2), _data(3)[1:]
    ref_losses, ref_evals, ref_params = _one_device(model, LOSS, train, held_out)
    plan = _plan(model, LOSS, train[0], "local:2", method="megatron:dp=1,tp=1,pp=2",
                 microbatches=1)
    assert plan.num_stages == 2
    params: dict = {}
    for losses, evals, state, copied in run_emulated_stages(
            _stage, plan.stage_meshes(), plan, model, LOSS, train, held_out):
        assert copied
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert sum(evals, []) == pytest.approx(sum(ref_evals, []), rel=1e-5)
        params.update(state)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)


def _predicting(comm, plan, model, train, held_out, p2p=None) -> tuple:
    mine = copy.deepcopy(model)
    par, opt = meshplan.parallelize(mine, torch.optim.SGD(mine.parameters(), lr=0.1), plan,
                                    LOSS, comm=comm, p2p=p2p)
    with pytest.raises(RuntimeError, match=r"call model.eval\(\) first"):
        par.predict(held_out[0])
    _loop(par, opt, train, [], lambda i, b: par(b))
    par.eval()
    out = [par.predict(b) for b in held_out]
    par.train()
    return out


@pytest.mark.parametrize("kw", [dict(mesh_shape=(1, 2), method="zero3"),
                                dict(method="megatron:dp=1,tp=1,pp=2", microbatches=1)],
                         ids=["zero3", "pipeline"])
def test_predict_gives_the_outputs_of_one_devices_model_in_evaluation(kw) -> None:
    """``model.predict(batch)`` after ``model.eval()``: the logits one device's model gives in
    evaluation mode after the same steps, on every rank (a validation pass's metrics)."""
    model, train, held_out = _net(), _data(2), _data(3)[1:]
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for i, ((x,), t) in enumerate(train):
        torch.manual_seed(i)
        LOSS(ref_model(x), t).backward()
        opt.step()
        opt.zero_grad()
    ref_model.eval()
    with torch.no_grad():
        ref = [ref_model(x) for (x,), _ in held_out]
    plan = _plan(model, LOSS, train[0], "local:2", **kw)
    run = (lambda f, *a: run_emulated_stages(lambda c, p, *b: f(c, *b, p), plan.stage_meshes(),
                                             *a)) if plan.num_stages > 1 else \
        (lambda f, *a: run_emulated(f, plan.mesh_shape, *a))
    for outs in run(_predicting, plan, model, train, held_out):
        for got, want in zip(outs, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
