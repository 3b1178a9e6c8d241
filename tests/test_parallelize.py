"""``meshplan.parallelize``: the user's own loop (forward, ``loss.backward()``, their optimizer's
``step()`` and ``zero_grad()``, an LR scheduler) runs a plan and trains exactly like one device,
with the optimizer's parameter groups (decay / no decay) kept."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

import meshplan
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.plan.plan import plan_from_json
from meshplan.runtime.emulated import run_emulated, run_emulated_stages
from meshplan.zoo.spec import build_workload
from hetero_cases import RATIOS, four_speeds
from meshplan.runtime.optim import OptimizerSpec
from oracle import assert_matches, batches, plain_training
from user_loop import one_device, parallel, train_steps

MLP = "mlp:layers=3,hidden=16,batch=8,bias=1"
BERT = "bert:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=8"
ADAMW = OptimizerSpec("adamw")   # the oracle's Adam comparison (norm-wise, sum-order noise)


def _reference(spec: str, data: list) -> tuple[list[float], dict]:
    return one_device(build_workload(spec, device="cpu", seed=0), data)


def _user_loop(comm, plan: meshplan.Plan, w, data: list, captured, p2p=None) -> tuple:
    # One workload for every rank: building it seeds the global RNG, which threads share.
    model, opt, sched = parallel(w, plan, comm=comm, p2p=p2p, captured=captured)
    losses = train_steps(model, opt, sched, data)
    return losses, model.full_state_dict(), [g["lr"] for g in opt.param_groups]


def _capture(w, plan: meshplan.Plan):
    return capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                          plan.microbatches)[0])


def _plan(spec: str, cluster, **kw) -> meshplan.Plan:
    w = build_workload(spec, device="meta")
    return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster,
                         memory_budget_gb=0, dtype="fp32", name=spec, **kw)


CASES = {
    "data": (MLP, dict(mesh_shape=(1, 4), method="data")),
    "zero2": (MLP, dict(mesh_shape=(1, 4), method="zero2")),
    "zero3": (BERT, dict(mesh_shape=(2, 2), method="zero3")),
    "megatron": (BERT, dict(mesh_shape=(1, 2), method="megatron")),
    "auto-2x2": (BERT, dict(mesh_shape=(2, 2), method="intra-only", microbatches=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_users_loop_trains_like_one_device(case: str) -> None:
    spec, kw = CASES[case]
    shape = kw["mesh_shape"]
    plan = _plan(spec, f"local:{shape[0] * shape[1]}", **kw)
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    ref_losses, ref_params = _reference(spec, data)
    for losses, params, lrs in run_emulated(_user_loop, plan.mesh_shape, plan, w, data,
                                            _capture(w, plan)):
        assert lrs == pytest.approx([0.01 * 0.5 ** 3] * 2)   # the scheduler drove the groups
        assert_matches((losses, params, []), (ref_losses, ref_params), plan, ADAMW)


def test_uneven_shares_on_a_mixed_cluster() -> None:
    plan = _plan(MLP, four_speeds(), method="hetero", axis_weights=RATIOS)
    w = build_workload(MLP, device="cpu", seed=0)
    data = batches(w, 3)
    ref_losses, ref_params = _reference(MLP, data)
    for losses, params, _ in run_emulated(_user_loop, plan.mesh_shape, plan, w, data,
                                          _capture(w, plan)):
        assert_matches((losses, params, []), (ref_losses, ref_params), plan, ADAMW)


def test_what_parallelize_refuses() -> None:
    w = build_workload(MLP, device="cpu", seed=0)
    plan = _plan(MLP, "local:4", mesh_shape=(1, 4), method="data")
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not parameters of this model"):
        meshplan.parallelize(w.model, other, plan, w.loss_fn, comm=object())
    with pytest.raises(RuntimeError, match="torch.distributed world"):
        meshplan.parallelize(w.model, torch.optim.SGD(w.model.parameters(), lr=0.1), plan,
                             w.loss_fn)


def _pipeline_loop(comm, p2p, plan: meshplan.Plan, w, data: list, captured) -> tuple:
    return _user_loop(comm, plan, w, data, captured, p2p)


def test_a_pipeline_in_the_users_loop_trains_like_one_device() -> None:
    # Interleaved: each rank runs two stages, its optimizer steps both; GPT's embedding is
    # tied to its LM head, so two stages hold it and sum its gradient.
    spec = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
    plan = _plan(spec, "local:2", method="megatron:dp=1,tp=1,pp=2,virtual=2", microbatches=4)
    assert plan.num_stages >= 2
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    ref_losses, ref_params = _reference(spec, data)
    results = run_emulated_stages(_pipeline_loop, plan.stage_meshes(), plan, w, data,
                                  _capture(w, plan))
    for losses, state, lrs in results:
        assert losses == pytest.approx(results[0][0], rel=1e-12)   # every rank reports it
        assert lrs == pytest.approx([0.01 * 0.5 ** 3] * 2)
        # full_state_dict is the whole model's on every rank, every stage's state included:
        # saved from any one rank, as the users' loop saves it.
        assert set(state) == set(w.model.state_dict())
        assert_matches((losses, state, []), (ref_losses, ref_params), plan, ADAMW)


def _other_model(comm, plan: meshplan.Plan, w, batch) -> None:
    model, _, _ = parallel(w, plan, comm=comm)
    model(batch)


def test_a_plan_of_another_model_is_refused_at_the_first_step() -> None:
    plan = _plan(MLP, "local:4", mesh_shape=(1, 4), method="data")
    other = build_workload("mlp:layers=2,hidden=8,batch=8", device="cpu", seed=0)
    with pytest.raises(ValueError, match="differs from the one the plan was made for"):
        run_emulated(_other_model, plan.mesh_shape, plan, other, other.example_batch)


def _grouped_sgd(model: torch.nn.Module, **second: float) -> torch.optim.SGD:
    """Weight decay on the matrices, none (and another learning rate) on the biases."""
    mats = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.SGD([{"params": mats, "weight_decay": 0.1},
                            {"params": rest, "weight_decay": 0.0, "lr": 0.02, **second}],
                           lr=0.05, momentum=0.9)


def _grouped_rank(comm, plan: meshplan.Plan, w, data: list, captured) -> tuple:
    from meshplan.runtime.trainer import Trainer
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    return [tr.step(b) for b in data], tr.full_state_dict()


@pytest.mark.parametrize("shape,method", [((1, 2), "data"), ((2, 2), "zero2")])
def test_a_plan_of_an_optimizer_with_groups_steps_each_group_by_its_own(shape, method) -> None:
    """The plan carries the groups (their parameters, and the learning rate and weight decay
    they set apart), and every rank's own optimizer steps each shard with its group's."""
    w = build_workload(MLP, device="cpu", seed=0)
    plan = meshplan.plan(w.model, w.loss_fn, _grouped_sgd(w.model), w.example_batch,
                         f"local:{shape[0] * shape[1]}", mesh_shape=shape, method=method,
                         memory_budget_gb=0, dtype="fp32")
    assert plan_from_json(json.loads(json.dumps(plan.to_json()))).optimizer == plan.optimizer
    data = batches(w, 3)
    model = build_workload(MLP, device="cpu", seed=0).model
    ref = plain_training(model, _grouped_sgd(model), w.loss_fn, data)
    for r in run_emulated(_grouped_rank, shape, plan, w, data, capture(w.model, w.loss_fn,
                                                                          w.example_batch)):
        assert_matches((*r, []), ref, plan, OptimizerSpec("sgd"))


def test_groups_apart_in_what_the_plan_cannot_carry_are_refused() -> None:
    w = build_workload(MLP, device="meta")
    with pytest.raises(ValueError, match=r"parameter group 1 sets \['momentum'\] apart"):
        meshplan.plan(w.model, w.loss_fn, _grouped_sgd(w.model, momentum=0.5),
                      w.example_batch, "local:2", mesh_shape=(1, 2))


def _accumulating_loop(comm, plan: meshplan.Plan, w, data: list, steps: int, p2p=None,
                       scales: tuple | None = None) -> tuple:
    """Gradient accumulation as Hugging Face's Trainer writes it: each loss divided by the
    number of batches per update (``scales``: each call's own divisor instead)."""
    import copy
    model = copy.deepcopy(w.model)
    model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan,
                                      w.loss_fn, comm=comm, p2p=p2p)
    losses = []
    for i, batch in enumerate(data):
        loss = model(batch)
        last = (i + 1) % steps == 0
        with contextlib.nullcontext() if last else model.no_sync():   # as DDP's loops write it
            (loss / (scales[i] if scales else steps)).backward()
        losses.append(loss.item())
        if (i + 1) % steps == 0:
            opt.step()
            opt.zero_grad()
    return losses, model.full_state_dict()


def _accumulating_stage(comm, p2p, plan, w, data, steps, scales=None) -> tuple:
    return _accumulating_loop(comm, plan, w, data, steps, p2p, scales)


ACCUMULATING = {
    "one micro-batch": (MLP, dict(mesh_shape=(1, 2), method="data")),
    "2 micro-batches": (MLP, dict(mesh_shape=(1, 2), method="data", microbatches=2)),
    "zero2, 2 micro-batches": (MLP, dict(mesh_shape=(1, 2), method="zero2", microbatches=2)),
    "zero3, 2 micro-batches": (BERT, dict(mesh_shape=(2, 2), method="zero3", microbatches=2)),
    "pipeline": (BERT, dict(method="megatron:dp=1,tp=1,pp=2", microbatches=2)),
}


@pytest.mark.parametrize("case", list(ACCUMULATING))
def test_a_loss_scaled_in_the_loop_accumulates_as_one_device(case: str) -> None:
    """The loop's scale reaches every gradient, as on one device, also where part of each
    call's backward runs inside the call with the loss as returned (earlier micro-batches, a
    pipeline's schedule): the step's gradients take it at synchronization."""
    import copy
    spec, kw = ACCUMULATING[case]
    w = build_workload(spec, device="cpu", seed=0)
    data, steps = batches(w, 4), 2
    model = copy.deepcopy(w.model)
    opt, ref = torch.optim.SGD(model.parameters(), lr=0.1), []
    for i, ((x,), t) in enumerate(data):
        loss = w.loss_fn(model(x), t)
        (loss / steps).backward()
        ref.append(loss.item())
        if (i + 1) % steps == 0:
            opt.step()
            opt.zero_grad()
    ref_state = {n: p.detach() for n, p in model.named_parameters()}
    shape = kw.get("mesh_shape", (1, 2))
    plan = _plan(spec, f"local:{shape[0] * shape[1]}", **kw)
    if plan.num_stages > 1:
        results, state = run_emulated_stages(_accumulating_stage, plan.stage_meshes(), plan, w,
                                             data, steps), {}
        for _, part in results:
            state.update(part)
        results = [(results[0][0], state)]
    else:
        results = run_emulated(_accumulating_loop, plan.mesh_shape, plan, w, data, steps)
    for losses, state in results:
        assert_matches((losses, state, []), (ref, ref_state), plan, OptimizerSpec("sgd"))


def test_calls_of_a_step_scaled_apart_are_refused_where_the_plan_accumulates() -> None:
    w = build_workload(MLP, device="cpu", seed=0)
    micro = _plan(MLP, "local:2", mesh_shape=(1, 2), method="data", microbatches=2)
    with pytest.raises(ValueError, match=r"gradient of 0.25, and an earlier call of this step 0.5"):
        run_emulated(_accumulating_loop, (1, 2), micro, w, batches(w, 2), 2, None, (2, 4))
    w = build_workload(BERT, device="cpu", seed=0)
    piped = _plan(BERT, "local:2", method="megatron:dp=1,tp=1,pp=2")
    with pytest.raises(ValueError, match=r"gradient of 0.25, and an earlier call of this"):
        run_emulated_stages(_accumulating_stage, piped.stage_meshes(), piped, w,
                            batches(w, 2), 2, (2, 4))


def _zero_grad_loop(comm, plan: meshplan.Plan, w, data: list) -> list[float]:
    import copy
    model = copy.deepcopy(w.model)
    model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan,
                                      w.loss_fn, comm=comm)
    losses = []
    for batch in data:
        loss = model(batch)
        loss.backward()
        opt.step()
        model.zero_grad()   # the module's, not the optimizer's
        losses.append(loss.item())
    with pytest.raises(TypeError, match=r"parameters are its ranks. shards.*clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return losses


def test_the_parallel_models_own_zero_grad_clears_and_its_parameters_explain() -> None:
    """``model.zero_grad()`` clears the shards' gradients as the optimizer's does (nn.Module's
    cleared nothing: the gradients accumulated over the steps); ``model.parameters()`` says
    where the parameters are, rather than an empty list that clip_grad_norm_ clips nothing of."""
    import copy
    w = build_workload(MLP, device="cpu", seed=0)
    data = batches(w, 4)
    model = copy.deepcopy(w.model)
    ref, _ = plain_training(model, torch.optim.SGD(model.parameters(), lr=0.1), w.loss_fn, data)
    plan = _plan(MLP, "local:2", mesh_shape=(1, 2), method="data")
    for losses in run_emulated(_zero_grad_loop, (1, 2), plan, w, data):
        assert losses == pytest.approx(ref, rel=1e-5)


CLIP = (0.05, 2.0)   # (max_norm, norm_type): every step clipped


def _clipped_steps(model, opt, sched, data: list, clip: tuple, one_device=None) -> tuple:
    """The user's loop with ``clip_grad_norm_`` between backward and step: on one device
    (``one_device``: the loss function) torch's over the model's parameters, else the
    parallel model's own."""
    losses, norms = [], []
    for i, batch in enumerate(data):
        if one_device is not None:
            torch.manual_seed(i)
            (x,), t = batch
            loss = one_device(model(x), t)
        else:
            loss = model(batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)
                           if one_device is not None else model.clip_grad_norm_(*clip)))
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, norms


def _clipping_rank(comm, plan: meshplan.Plan, w, data: list, captured, clip: tuple,
                   p2p=None) -> tuple:
    model, opt, sched = parallel(w, plan, comm=comm, p2p=p2p, captured=captured)
    losses, norms = _clipped_steps(model, opt, sched, data, clip)
    return losses, norms, model.full_state_dict()


def _clipping_stage(comm, p2p, plan, w, data, captured, clip) -> tuple:
    return _clipping_rank(comm, plan, w, data, captured, clip, p2p)


def _one_device_clipped(spec: str, data: list, clip: tuple) -> tuple:
    import copy
    from user_loop import optimizer_for
    w = build_workload(spec, device="cpu", seed=0)
    model = copy.deepcopy(w.model)
    opt, sched = optimizer_for(model)
    losses, norms = _clipped_steps(model, opt, sched, data, clip, one_device=w.loss_fn)
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


CLIP_CASES = {
    **{name: (spec, kw, CLIP) for name, (spec, kw) in CASES.items()},
    "zero3-inf": (BERT, dict(mesh_shape=(2, 2), method="zero3"), (0.01, float("inf"))),
    "megatron-l1": (BERT, dict(mesh_shape=(1, 2), method="megatron"), (0.5, 1.0)),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clip_grad_norm_in_the_users_loop_clips_as_one_device(case: str) -> None:
    """``model.clip_grad_norm_`` (FSDP's name) between backward and step: the norm over every
    rank's gradients, each element once, returned alike on every rank and clipped by, as
    torch.nn.utils.clip_grad_norm_ on one device; the optimizer's step synchronizes nothing
    again."""
    spec, kw, clip = CLIP_CASES[case]
    shape = kw["mesh_shape"]
    plan = _plan(spec, f"local:{shape[0] * shape[1]}", **kw)
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    ref_losses, ref_norms, ref_params = _one_device_clipped(spec, data, clip)
    assert min(ref_norms) > clip[0]   # every step is clipped
    for losses, norms, params in run_emulated(_clipping_rank, plan.mesh_shape, plan, w, data,
                                              _capture(w, plan), clip):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert_matches((losses, params, []), (ref_losses, ref_params), plan, ADAMW)


def test_clip_grad_norm_over_a_pipelines_stages_clips_as_one_device() -> None:
    # Interleaved, the embedding tied to the head: two stages of a rank, a parameter two
    # stages hold, counted once.
    spec = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
    plan = _plan(spec, "local:2", method="megatron:dp=1,tp=1,pp=2,virtual=2", microbatches=4)
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)
    for clip in (CLIP, (0.01, float("inf"))):
        ref_losses, ref_norms, ref_params = _one_device_clipped(spec, data, clip)
        assert min(ref_norms) > clip[0]
        params: dict = {}
        results = run_emulated_stages(_clipping_stage, plan.stage_meshes(), plan, w, data,
                                      _capture(w, plan), clip)
        for losses, norms, state in results:
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            params.update(state)
        assert_matches((results[0][0], params, []), (ref_losses, ref_params), plan, ADAMW)


def _misplaced_clips(comm, plan: meshplan.Plan, w, data: list) -> None:
    import copy
    model = copy.deepcopy(w.model)
    model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan,
                                      w.loss_fn, comm=comm)
    with pytest.raises(RuntimeError, match="call it on a batch"):
        model.clip_grad_norm_(1.0)
    loss = model(data[0])
    with pytest.raises(RuntimeError, match="before loss.backward"):
        model.clip_grad_norm_(1.0)
    loss.backward()
    with pytest.raises(ValueError, match="norm_type must be a number > 0"):
        model.clip_grad_norm_(1.0, norm_type=0)
    with pytest.raises(ValueError, match="max_norm must be a finite number"):
        model.clip_grad_norm_(float("nan"))
    model.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="synchronized .*another forward would add"):
        model(data[1])
    opt.zero_grad()   # dropped unapplied (a step skipped): the next step begins afresh
    model(data[1]).backward()
    model.clip_grad_norm_(1.0)
    opt.step()


def test_clip_grad_norm_out_of_place_is_refused() -> None:
    w = build_workload(MLP, device="cpu", seed=0)
    plan = _plan(MLP, "local:2", mesh_shape=(1, 2), method="data", microbatches=2)
    run_emulated(_misplaced_clips, (1, 2), plan, w, batches(w, 2))


def _resumed_rank(comm, plan: meshplan.Plan, w, data: list, state: dict, captured,
                  p2p=None) -> tuple:
    """Load a whole state (one device's after its first step) before the first call or after
    a step, then train on: the steps from that state."""
    model, opt, sched = parallel(w, plan, comm=comm, p2p=p2p, captured=captured)
    with pytest.raises(TypeError, match=r"state is its ranks' shards.*full_state_dict"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"missing key\(s\) \['.*unexpected key\(s\) \['x'\]"):
        model.load_state_dict({"x": torch.zeros(1)})
    model.load_state_dict(state)                  # held until the first call
    first = train_steps(model, opt, sched, data[1:2])
    model.load_state_dict(state)                  # the trainers' own
    wrong = {k: v[..., :1] if v.dim() else v for k, v in state.items()}
    with pytest.raises(ValueError, match="at shape"):
        model.load_state_dict(wrong)
    return first, model.full_state_dict()


def _resumed_stage(comm, p2p, plan, w, data, state, captured) -> tuple:
    return _resumed_rank(comm, plan, w, data, state, captured, p2p)


@pytest.mark.parametrize("case", ["zero2", "zero3", "auto-2x2", "pipeline"])
def test_load_state_dict_takes_a_whole_state_into_the_ranks_pieces(case: str) -> None:
    """``model.load_state_dict(one device's state_dict())`` before the first call and after a
    step: each rank's pieces as the start takes them, the step from there as one device's;
    ``model.state_dict()`` refuses, naming full_state_dict (nn.Module's was an empty dict, a
    checkpoint of nothing)."""
    import copy
    from user_loop import optimizer_for
    if case == "pipeline":
        spec, kw = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8", dict(
            method="megatron:dp=1,tp=1,pp=2", microbatches=2)
    else:
        spec, kw = CASES[case]
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 2)
    one = copy.deepcopy(w.model)
    opt, _ = optimizer_for(one)
    (x,), t = data[0]
    w.loss_fn(one(x), t).backward()
    opt.step()
    state = {k: v.detach().clone() for k, v in one.state_dict().items()}
    # From that state, one step by a fresh optimizer: the reference.
    fresh = copy.deepcopy(w.model)
    fresh.load_state_dict(state)
    ref_losses, _ = one_device(dataclasses.replace(w, model=fresh), data[1:2])
    shape = kw.get("mesh_shape", (1, 2))
    plan = _plan(spec, f"local:{shape[0] * shape[1]}", **kw)
    if plan.num_stages > 1:
        results = run_emulated_stages(_resumed_stage, plan.stage_meshes(), plan, w, data, state,
                                      _capture(w, plan))
    else:
        results = run_emulated(_resumed_rank, plan.mesh_shape, plan, w, data, state,
                               _capture(w, plan))
    params: dict = {}
    for losses, part in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        params.update(part)
    # After the reload, the trainers hold that state again.
    for name, value in state.items():
        if name in params:
            torch.testing.assert_close(params[name], value, rtol=0, atol=0)


def _summed_calls(comm, plan: meshplan.Plan, w, data: list, weight: float) -> tuple:
    """Two calls' losses summed (``weight`` on the second), one backward, then a clip: and
    first a call whose backward never runs (a loss looked at with gradients on)."""
    import copy
    model = copy.deepcopy(w.model)
    model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan,
                                      w.loss_fn, comm=comm)
    model(data[0])   # never backpropagated: due no longer once the step is done
    opt.zero_grad()
    losses, norms = [], []
    for i in range(0, len(data), 2):
        loss = model(data[i]) + weight * model(data[i + 1])
        loss.backward()
        norms.append(float(model.clip_grad_norm_(CLIP[0])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.full_state_dict()


@pytest.mark.parametrize("method, microbatches", [("data", 1), ("zero2", 1), ("data", 2)])
def test_two_calls_summed_into_one_backward_train_as_one_device(method, microbatches) -> None:
    """``(model(a) + model(b)).backward()``: the first call's buckets were all-reduced while
    the second's backward had yet to add to them (one micro-batch, replicated: 0.045 off one
    device after two steps); a call made while another's backward is due now leaves them to
    the step's synchronization."""
    import copy
    w = build_workload(MLP, device="cpu", seed=0)
    data = batches(w, 4)
    weight = 1.0 if microbatches > 1 else 0.5
    model = copy.deepcopy(w.model)
    opt, ref, ref_norms = torch.optim.SGD(model.parameters(), lr=0.1), [], []
    for i in range(0, 4, 2):
        (x1,), t1 = data[i]
        (x2,), t2 = data[i + 1]
        loss = w.loss_fn(model(x1), t1) + weight * w.loss_fn(model(x2), t2)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[0])))
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    plan = _plan(MLP, "local:2", mesh_shape=(1, 2), method=method, microbatches=microbatches)
    for losses, norms, state in run_emulated(_summed_calls, (1, 2), plan, w, data, weight):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert_matches((losses, state, []), (ref, {n: p.detach() for n, p in
                                                   model.named_parameters()}),
                       plan, OptimizerSpec("sgd"))


def _unbackpropagated_first(comm, p2p, plan: meshplan.Plan, w, data: list, zero: bool) -> tuple:
    """A call whose loss is never backpropagated (a look at the loss with gradients on), then
    the loop; ``zero``: with ``optimizer.zero_grad()`` after that call."""
    model, opt, sched = parallel(w, plan, comm=comm, p2p=p2p, captured=_capture(w, plan))
    model(data[0])
    if zero:
        opt.zero_grad()
    return train_steps(model, opt, sched, data[1:]), model.full_state_dict()


@pytest.mark.parametrize("kw", [dict(method="megatron:dp=1,tp=1,pp=2", microbatches=2),
                                dict(mesh_shape=(1, 2), method="data", microbatches=2)],
                         ids=["pipeline", "micro-batches"])
def test_a_call_never_backpropagated_is_refused_at_the_step_unless_zeroed(kw) -> None:
    """Where a plan runs part of each call's backward inside the call (a pipeline's schedule,
    earlier micro-batches), a call whose backward never runs leaves gradients one device's
    would not have: the step refuses them, naming zero_grad, and after zero_grad the loop
    trains as one device."""
    spec = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
    plan = _plan(spec, "local:2", **kw)
    w = build_workload(spec, device="cpu", seed=0)
    data = batches(w, 3)

    def run(zero: bool) -> list:
        if plan.num_stages > 1:
            return run_emulated_stages(_unbackpropagated_first, plan.stage_meshes(), plan, w,
                                       data, zero)
        return run_emulated(lambda comm, *a: _unbackpropagated_first(comm, None, *a),
                            plan.mesh_shape, plan, w, data, zero)
    with pytest.raises(RuntimeError, match=r"loss.backward\(\) never ran.*optimizer.zero_grad"):
        run(False)
    ref_losses, ref_params = _reference(spec, data[1:])
    for losses, state in run(True):
        assert_matches((losses, state, []), (ref_losses, ref_params), plan, ADAMW)


def _compiled_loop(comm, plan: meshplan.Plan, w, data: list) -> tuple:
    import copy
    from user_loop import optimizer_for
    model = torch.compile(copy.deepcopy(w.model))   # never run compiled: meshplan runs it
    opt, sched = optimizer_for(model)
    model, opt = meshplan.parallelize(model, opt, plan, w.loss_fn, comm=comm)
    return train_steps(model, opt, sched, data), model.full_state_dict()


def test_a_compiled_model_plans_and_trains_as_the_module_it_wraps() -> None:
    """``torch.compile(model)`` given to plan and parallelize: the module it wraps is traced
    and run, its state under its own names (not ``_orig_mod.``)."""
    w = build_workload(MLP, device="cpu", seed=0)
    data = batches(w, 2)
    plan = meshplan.plan(torch.compile(w.model), w.loss_fn, "adamw", w.example_batch,
                         "local:2", mesh_shape=(1, 2), method="zero2", memory_budget_gb=0,
                         dtype="fp32")
    ref = _reference(MLP, data)
    for losses, state in run_emulated(_compiled_loop, (1, 2), plan, w, data):
        assert set(state) == set(w.model.state_dict())
        assert_matches((losses, state, []), ref, plan, ADAMW)


class _SparseTables(torch.nn.Module):
    """Embeddings with sparse gradients (``sparse=True``), as recommenders write them."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = torch.nn.Embedding(20, 8, sparse=True)
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="mean", sparse=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.ids(ids).mean(1), self.bag(ids)], -1))


def _sparse_loop(comm, plan, start, data) -> tuple:
    import copy
    model = copy.deepcopy(start)
    model, opt = meshplan.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan,
                                      torch.nn.functional.mse_loss, comm=comm)
    return train_steps(model, opt, None, data), model.full_state_dict()


@pytest.mark.parametrize("method, microbatches", [("data", 1), ("zero3", 2)])
def test_embeddings_with_sparse_gradients_train_as_one_device(method, microbatches) -> None:
    """Their gradients are made dense (the runtime accumulates, synchronizes and shards dense
    tensors: a sparse one failed in the first accumulation); SGD steps on the same values."""
    import copy
    torch.manual_seed(0)
    start = _SparseTables()
    g = torch.Generator().manual_seed(1)
    data = [((torch.randint(0, 20, (8, 5), generator=g),), torch.randn(8, 4, generator=g))
            for _ in range(3)]
    one = copy.deepcopy(start)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    ref = []
    for (x,), t in data:
        loss = torch.nn.functional.mse_loss(one(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    plan = meshplan.plan(start, torch.nn.functional.mse_loss, OptimizerSpec("sgd", lr=0.1),
                         data[0], "local:2", mesh_shape=(1, 2), method=method,
                         microbatches=microbatches, memory_budget_gb=0, dtype="fp32")
    for losses, state in run_emulated(_sparse_loop, (1, 2), plan, start, data):
        assert losses == pytest.approx(ref, rel=1e-5)
        for name, value in one.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
