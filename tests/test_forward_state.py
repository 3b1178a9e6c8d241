"""What a forward does besides computing its loss, as one device does it: buffers it updates
(batch norm's running statistics and counter, a running normalizer that the next step reads)
and values it computes without gradients (``torch.no_grad()``, a custom autograd.Function).
Every plan trains them as one device does, recomputed or not, over micro-batches as gradient
accumulation does, in pipeline stages, and through a checkpoint on gloo."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated_stages
from meshplan.runtime.pipeline import PipelineTrainer
from oracle import plain_training, trained_states

SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2)]


class RunningStats(nn.Module):
    """Convolutions with batch norm (running statistics, a counter), a running mean of the
    outputs that the next step subtracts, and a scale computed without gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("mu", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.c1(x)))
        h = F.relu(self.bn2(self.c2(h))).mean((2, 3))
        with torch.no_grad():
            scale = h.abs().mean() + 1.0
        out = self.fc(h / scale)
        with torch.no_grad():
            self.mu.mul_(0.5).add_(out.mean(0), alpha=0.5)
        return out - self.mu


class _Twice(torch.autograd.Function):
    """2x + 1 with its own backward: meshplan differentiates the traced forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class _Residual(torch.autograd.Function):
    """tanh(x)·2 + x: its last op reads the input beside its own intermediate."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x)
        ctx.save_for_backward(a)
        return a * 2 + x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return g * (2 * (1 - a * a) + 1)


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Residual.apply(torch.tanh(_Twice.apply(self.a(x)))))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class Checkpointed(nn.Module):
    """Blocks recomputed by torch.utils.checkpoint, reentrant (an autograd.Function whose
    forward runs the block under no_grad: older Hugging Face models' gradient checkpointing)
    and not; and a frozen teacher's linear layer run under no_grad, its output used: one
    device gives its weight no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.teacher = nn.Linear(6, 8), nn.Linear(6, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        with torch.no_grad():
            hint = self.teacher(x)
        h = self.inp(x) + hint
        for k, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=k != 1)
        return self.out(h)


MODELS = {"running": (RunningStats, (8, 3, 6, 6)), "function": (WithFunction, (8, 6)),
          "checkpointed": (Checkpointed, (8, 6))}


def _batches(name: str, n: int) -> list:
    shape = MODELS[name][1]
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(shape, generator=g),), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _one_device(name: str, data: list, microbatches: int = 1) -> tuple[list[float], dict]:
    """Plain training with gradient accumulation over ``microbatches`` equal cuts."""
    model = MODELS[name][0]()
    return plain_training(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                          data, microbatches)


def _plan(model: nn.Module, example: Any, cluster: str, **kw: Any) -> api.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # micro-batches: inexact, said in its own test
        return api.plan(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(),
                                                                       lr=0.1),
                        example, cluster, dtype="fp32", memory_budget_gb=0, **kw)


def _check(losses: list[float], state: dict, ref: tuple[list[float], dict]) -> None:
    assert losses == pytest.approx(ref[0], rel=1e-5)
    for k, v in ref[1].items():
        got = state[k].to(v.dtype)
        assert torch.allclose(got, v, rtol=1e-5, atol=1e-6), (k, got.flatten()[:4],
                                                             v.flatten()[:4])


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_buffers_and_constants_train_as_on_one_device(shape: tuple[int, int],
                                                      microbatches: int,
                                                      recompute: str) -> None:
    """Each rank updates its own buffers from the whole batch's values, once per micro-batch
    as accumulation does, and a replay in backward neither updates them again nor reads them
    updated; the scale made under no_grad passes no gradient. The user's model is left as it
    was (the trainers hold their own state)."""
    model = RunningStats()
    before = copy.deepcopy(model.state_dict())
    data = _batches("running", 3)
    plan = _plan(model, data[0], f"local:{shape[0] * shape[1]}", mesh_shape=shape,
                 microbatches=microbatches, recompute=recompute)

    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, _one_device("running", data, microbatches))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_custom_function_keeps_its_gradient() -> None:
    """An autograd.Function's forward runs without gradients, but its output has them: its
    traced forward is differentiated."""
    model, data = WithFunction(), _batches("function", 3)
    plan = _plan(model, data[0], "local:4", mesh_shape=(2, 2))

    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, _one_device("function", data))


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_checkpointed_blocks_and_a_no_grad_layer_train_as_on_one_device(shape) -> None:
    """A reentrant checkpoint's blocks (each op of its forward made under no_grad, its
    output's gradient autograd's) keep their gradients: the matmuls inside each linear, which
    no call of the model's own makes, were taken as recorded from their weights, and the
    blocks' weights got none. The teacher's weight, read under no_grad, gets none."""
    model, data = Checkpointed(), _batches("checkpointed", 3)
    ref = _one_device("checkpointed", data)
    assert torch.equal(ref[1]["teacher.weight"], model.teacher.weight)
    plan = _plan(model, data[0], f"local:{shape[0] * shape[1]}", mesh_shape=shape)
    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, ref)


def test_updating_a_buffer_per_micro_batch_is_named_inexact() -> None:
    model = RunningStats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = api.plan(model, nn.CrossEntropyLoss(), "sgd", _batches("running", 1)[0],
                        "local:2", mesh_shape=(1, 2), memory_budget_gb=0, microbatches=2)
    said = [str(c.message) for c in caught if "micro-batch" in str(c.message)]
    assert said and "'bn1.num_batches_tracked'" in said[0], said
    assert plan.options["microbatch_loss"]["exact"] is False


@pytest.mark.parametrize("method,devices", [("megatron:dp=1,tp=1,pp=2", 2),
                                            ("megatron:dp=2,tp=1,pp=2", 4)])
def test_pipeline_stages_update_their_buffers(method: str, devices: int) -> None:
    model, data = RunningStats(), _batches("running", 3)
    plan = _plan(model, data[0], f"local:{devices}", method=method, microbatches=2,
                 num_layers=2)
    assert plan.num_stages == 2
    for losses, state in trained_states(plan, model, nn.CrossEntropyLoss(), data):
        _check(losses, state, _one_device("running", data, 2))


class LateUpdate(nn.Module):
    """A buffer read by the first layer and updated from the last layer's output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 32), nn.Linear(32, 6)
        self.register_buffer("mu", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x - self.mu)))
        with torch.no_grad():
            self.mu.mul_(0.5).add_(out.mean(0), alpha=0.5)
        return out


def test_a_buffer_updated_in_another_stage_than_it_is_read_is_refused() -> None:
    model = LateUpdate()
    example = ((torch.randn(8, 6),), torch.randint(0, 6, (8,)))
    plan = _plan(model, example, "local:2", method="megatron:dp=1,tp=1,pp=2", num_layers=2)
    captured = capture(model, nn.CrossEntropyLoss(), example)

    def rank(comm: Any, p2p: Any) -> None:
        PipelineTrainer(plan, model, nn.CrossEntropyLoss(), example, comm, p2p,
                        captured=captured)

    with pytest.raises(NotImplementedError, match=r"buffer 'mu' is updated by pipeline stage 1 "
                                                  r"and read by stage 0"):
        run_emulated_stages(rank, plan.stage_meshes())


def _resume(rank: int, nprocs: int, plan: api.Plan, path: str
            ) -> tuple[list[float], list[float]]:
    """Four steps of ``plan`` through `meshplan.parallelize`, saving after two; the last two
    again from that checkpoint in a new parallel model; the state after four saved."""
    data = _batches("running", 4)
    loss_fn = nn.CrossEntropyLoss()

    def parallel() -> tuple[Any, Any]:
        m = RunningStats()
        return meshplan.parallelize(m, torch.optim.SGD(m.parameters(), lr=0.1), plan, loss_fn)

    pm, opt = parallel()
    losses = []
    for step, b in enumerate(data):
        if step == 2:
            meshplan.save_checkpoint(os.path.join(path, "two"), pm, opt)
        loss = pm(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    meshplan.save_checkpoint(os.path.join(path, "four"), pm, opt)
    pm, opt = parallel()
    meshplan.load_checkpoint(os.path.join(path, "two"), pm, opt)
    again = []
    for b in data[2:]:
        loss = pm(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        again.append(loss.item())
    return losses, again


@pytest.mark.parametrize("method", ["data", "megatron:dp=1,tp=1,pp=2"])
def test_a_checkpoint_holds_the_buffers(pool2, tmp_path, method: str) -> None:
    """Saved and resumed on gloo, the buffers come back (a resumed run's losses are the
    uninterrupted one's), and `load_model_state` gives a plain model one device's state."""
    ref = _one_device("running", _batches("running", 4))
    plan = _plan(RunningStats(), _batches("running", 1)[0], "local:2", method=method,
                 num_layers=2, **({} if method.startswith("megatron") else {"mesh_shape": (1, 2)}))
    for losses, again in pool2.run(_resume, plan, str(tmp_path)):
        assert losses == pytest.approx(ref[0], rel=1e-5)
        assert again == pytest.approx(ref[0][2:], rel=1e-5)
    plain = RunningStats()
    meshplan.load_model_state(str(tmp_path / "four"), into=plain)
    _check(ref[0], plain.state_dict(), ref)
