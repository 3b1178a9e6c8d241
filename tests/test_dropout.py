"""Dropout on any sharding equals single-device dropout with the same seed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import make_optimizer
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import Workload
from oracle import SGD, shared_capture

SEEDS = (100, 101, 102)


def _workload() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 16),
                          nn.Dropout(0.5))
    return Workload(model, F.mse_loss, ((torch.randn(8, 16),), torch.randn(8, 16)), "dropout")


def _single_device(w: Workload) -> tuple[list[float], dict]:
    model = copy.deepcopy(w.model)
    opt = make_optimizer(SGD, model.parameters())
    losses = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        loss = w.loss_fn(model(*w.example_batch[0]), w.example_batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _rank(comm, plan, w: Workload, captured) -> tuple[list[float], dict]:
    trainer = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    losses = [trainer.step(w.example_batch, seed=s) for s in SEEDS]
    return losses, trainer.full_state_dict()


@pytest.mark.parametrize("shape", [(1, 2), (1, 4), (2, 2)], ids=["1x2", "1x4", "2x2"])
@pytest.mark.parametrize("method", ["auto", "data", "megatron"])
def test_dropout_matches_single_device_with_the_same_seed(method: str, shape) -> None:
    w = _workload()
    units = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mask ops have signatures: no replicated fallback
        plan = meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch,
                             f"local:{shape[0] * shape[1]}", mesh_shape=shape, method=method,
                             memory_budget_gb=0, **units)
    ref_losses, ref_params = _single_device(w)
    for losses, params in run_emulated(_rank, shape, plan, w, shared_capture(w)):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_params.items():
            assert (params[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name


# ---------------------------------------------------------------- micro-batches and stages
def _hf(name: str) -> tuple[Workload, list]:
    """A Hugging Face model as its authors wrote it: dropout on the embeddings (BERT's after
    their layer norm), attention probabilities and residuals (0.1 each), -100 labels on
    padding, its own loss."""
    import test_hf_models as hf
    return Workload(hf.build(name), None, hf.batch(name, 0), name), hf.data(name)


def _hf_rank(comm, plan, w: Workload, data) -> tuple[list[float], dict, list]:
    trainer = Trainer(plan, w.model, None, w.example_batch, comm)
    return [trainer.step(b, seed=i) for i, b in enumerate(data)], \
        trainer.full_state_dict(), []


def _hf_stage_rank(comm, p2p, plan, w: Workload, data) -> tuple:
    from meshplan.runtime.pipeline import PipelineTrainer
    trainer = PipelineTrainer(plan, w.model, None, w.example_batch, comm, p2p)
    return [trainer.step(b, seed=i) for i, b in enumerate(data)], trainer.full_state_dict()


@pytest.mark.parametrize("name,method,devices,microbatches,recompute", [
    ("gpt2", "data", 2, 2, "none"), ("gpt2", "megatron", 2, 2, "full"),
    ("gpt2", "zero3", 2, 4, "none"), ("gpt2", "megatron:dp=1,tp=1,pp=2", 2, 1, "none"),
    ("gpt2", "megatron:dp=1,tp=2,pp=2", 4, 2, "none"),
    ("gpt2", "megatron:dp=2,tp=1,pp=2", 4, 2, "full"), ("bert", "data", 2, 2, "none"),
    ("bert", "megatron:dp=1,tp=1,pp=2", 2, 2, "none")])
def test_micro_batches_and_stages_draw_the_masks_of_one_device(
        name: str, method: str, devices: int, microbatches: int, recompute: str) -> None:
    # Each micro-batch (each pipeline stage) draws its rows of the whole batch's masks, from
    # the generator state one device reaches at that dropout.
    from meshplan.runtime.emulated import run_emulated_stages
    from oracle import assert_matches
    w, data = _hf(name)
    mesh = {} if ":" in method else {"mesh_shape": (1, devices)}
    plan = meshplan.plan(w.model, None, SGD, w.example_batch, f"local:{devices}",
                         method=method, memory_budget_gb=0, microbatches=microbatches,
                         recompute=recompute, dtype="fp32", **mesh)
    import test_hf_models as hf
    ref = hf.reference(name, SGD)   # step i after torch.manual_seed(i)
    if plan.num_stages == 1:
        for r in run_emulated(_hf_rank, plan.mesh_shape, plan, w, data):
            assert_matches(r, ref, plan, SGD)
        return
    results = run_emulated_stages(_hf_stage_rank, plan.stage_meshes(), plan, w, data)
    params: dict = {}
    for _, state in results:
        params.update(state)
    assert_matches((results[0][0], params, []), ref, plan, SGD)


def test_a_mask_whose_batch_the_ir_misses_is_found_at_another_batch_size(monkeypatch) -> None:
    # Should the IR's batch dims miss where a mask carries the batch, its shape at another
    # batch size shows it: the masks stay one device's, never one shared by every micro-batch.
    import meshplan.runtime.dropout as dropout
    monkeypatch.setattr(dropout, "_shaped_like", lambda draw, batched: frozenset())
    test_micro_batches_and_stages_draw_the_masks_of_one_device("bert", "data", 2, 2, "none")
