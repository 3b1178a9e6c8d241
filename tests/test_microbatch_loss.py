"""A step of M micro-batches is one full-batch step, whatever the loss's reductions (issue 25.1,
`lower/microbatch.py`): cross-entropy means over -100-padded labels whose padding differs
between micro-batches (Hugging Face models computing their own loss included), class weights,
sums, and mixtures — single-stage plans and pipelines, 1/2/4 micro-batches, against one
device's single forward and backward of the whole batch. A loss micro-batches cannot add up is
named when planning."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.capture.batch import (batch_size, flatten_batch, split_microbatches,
                                   step_loss)
from meshplan.capture.to_ir import capture
from meshplan.lower.microbatch import batch_reductions
from meshplan.runtime.emulated import run_emulated, run_emulated_stages
from meshplan.runtime.optim import OptimizerSpec
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import Workload

import transformers  # noqa: E402 -- pinned in the test extra

SGD = OptimizerSpec("sgd", lr=0.1)
VOCAB, SEQ, BATCH = 64, 8, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _padded_labels(g: torch.Generator) -> torch.Tensor:
    """Labels with -100 on a padding that differs a lot between rows (so between
    micro-batches: row r keeps r+1 real targets... most of the first rows are padding)."""
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for r in range(BATCH):
        labels[r, (r % SEQ) + 1:] = -100
    return labels


def _lm_workload(loss: Callable) -> Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return Workload(TinyLM(), loss, ((ids,), _padded_labels(g)), "tiny-lm")


def _ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-100)


_WEIGHT = torch.linspace(0.5, 2.0, VOCAB)


def _weighted_ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-100,
                           weight=_WEIGHT)


def _summed_ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-100,
                           reduction="sum") / 50.0


def _masked_mean(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # The masked mean as written by hand: per-token losses, summed over the real ones and
    # divided by their count, a statistic of the data (the whole batch's in every micro-batch).
    tok = F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1).clamp(min=0), reduction="none")
    keep = (t != -100).reshape(-1)
    return (tok * keep).sum() / keep.sum().clamp(min=1)


def _mixed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A padded cross-entropy plus a small penalty on the logits' mean square: two
    # reductions over the batch of different kinds, each with its own scale.
    return _ce(out, t) + 0.01 * out.pow(2).mean()


def _batches(w: Workload, n: int) -> list:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(10 + i)
        (ids,), _ = w.example_batch
        out.append(((torch.randint(0, VOCAB, ids.shape, generator=g),), _padded_labels(g)))
    return out


def full_batch_reference(w: Workload, data: list) -> tuple[list[float], dict]:
    """One device, one forward and one backward of each whole batch: the oracle."""
    model = copy.deepcopy(w.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in data:
        layout, tensors = flatten_batch(batch)
        args, kwargs, target = layout.call(list(tensors.values()))
        loss = step_loss(w.loss_fn, model(*args, **kwargs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _check(got: tuple[list[float], dict], ref: tuple[list[float], dict]) -> None:
    losses, params = got
    ref_losses, ref_params = ref
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    for name, r in ref_params.items():
        err = (params[name] - r).abs().max().item()
        assert err <= 1e-5 * max(r.abs().max().item(), 1e-3), (name, err)


def _rank(comm, plan, w, data, captured) -> tuple:
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    return [tr.step(b, seed=i) for i, b in enumerate(data)], tr.full_state_dict()


def _stage_rank(comm, p2p, plan, w, data, captured) -> tuple:
    tr = PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, p2p,
                         captured=captured)
    return [tr.step(b, seed=i) for i, b in enumerate(data)], tr.full_state_dict()


def _train(w: Workload, plan: meshplan.Plan, data: list) -> tuple[list[float], dict]:
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                              plan.microbatches)[0])
    if plan.num_stages > 1:
        results = run_emulated_stages(_stage_rank, plan.stage_meshes(), plan, w, data,
                                      captured)
        params: dict = {}
        for _, state in results:
            params.update(state)
        return results[0][0], params
    return run_emulated(_rank, plan.mesh_shape, plan, w, data, captured)[0]


def _plan(w: Workload, cluster: str, **kw: Any) -> meshplan.Plan:
    return meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, cluster, memory_budget_gb=0,
                         **kw)


LOSSES = {"ce": _ce, "weighted": _weighted_ce, "sum": _summed_ce, "mixed": _mixed,
          "masked": _masked_mean}
KINDS = {"ce": ["nll_mean"], "weighted": ["nll_mean"], "sum": ["nll_sum"],
         "mixed": ["nll_mean", "mean"], "masked": ["stat_sum", "sum"]}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_each_reduction_is_found_with_its_kind(loss: str) -> None:
    w = _lm_workload(LOSSES[loss])
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    found = batch_reductions(graph)
    assert found.inexact is None
    assert sorted(r.kind for r in found.found) == sorted(KINDS[loss])


@pytest.mark.parametrize("loss,method,shape,micro", [
    ("ce", "data", (1, 2), 2), ("ce", "zero3", (2, 2), 4), ("ce", "intra-only", (2, 2), 2),
    ("weighted", "data", (1, 4), 4), ("sum", "megatron", (1, 2), 2),
    ("mixed", "data", (2, 1), 2), ("masked", "data", (1, 2), 4), ("masked", "zero3", (2, 2), 2)])
def test_micro_batches_make_the_full_batch_step(loss: str, method: str, shape, micro: int
                                                ) -> None:
    w = _lm_workload(LOSSES[loss])
    plan = _plan(w, f"local:{shape[0] * shape[1]}", mesh_shape=shape, method=method,
                 microbatches=micro)
    data = _batches(w, 3)
    _check(_train(w, plan, data), full_batch_reference(w, data))


def test_a_pipeline_makes_the_full_batch_step() -> None:
    w = _lm_workload(_ce)
    plan = _plan(w, "local:4", method="megatron:dp=1,tp=2,pp=2", microbatches=4)
    assert plan.num_stages == 2
    data = _batches(w, 3)
    _check(_train(w, plan, data), full_batch_reference(w, data))


def _hf(name: str) -> Workload:
    t = transformers
    torch.manual_seed(0)
    if name == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32,
                                               n_layer=2, n_head=4, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    labels = ids.clone()
    for r in range(BATCH):   # right padding, more in the first rows
        mask[r, (r % SEQ) + 2:] = 0
        labels[r, (r % SEQ) + 2:] = -100
    return Workload(model.train(), None, {"input_ids": ids, "attention_mask": mask,
                                          "labels": labels}, name)


def _hf_batches(w: Workload, n: int) -> list:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(20 + i)
        b = {k: v.clone() for k, v in w.example_batch.items()}
        b["input_ids"] = torch.randint(0, VOCAB, b["input_ids"].shape, generator=g)
        b["labels"] = torch.where(b["labels"] == -100, -100, b["input_ids"])
        out.append(b)
    return out


@pytest.mark.parametrize("name,method,micro", [("gpt2", "data", 2), ("llama", "zero3", 4),
                                               ("gpt2", "megatron:dp=1,tp=1,pp=2", 4)])
def test_hugging_face_models_with_their_own_loss_make_the_full_batch_step(
        name: str, method: str, micro: int) -> None:
    w = _hf(name)
    kw = {} if "pp=" in method else {"mesh_shape": (1, 2)}
    plan = _plan(w, "local:2", method=method, microbatches=micro, **kw)
    data = _hf_batches(w, 2)
    _check(_train(w, plan, data), full_batch_reference(w, data))


def _gloo(rank: int, nprocs: int, plan, data) -> tuple:
    from meshplan.runtime.comm import ProcessGroupComm
    w = _lm_workload(_ce)
    return _rank(ProcessGroupComm(plan.mesh_shape), plan, w, data, None)


def test_the_full_batch_step_on_gloo(pool2) -> None:
    w = _lm_workload(_ce)
    plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=4)
    data = _batches(w, 2)
    ref = full_batch_reference(w, data)
    for got in pool2.run(_gloo, plan, data):
        _check(got, ref)


def _rms(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (out.reshape(-1, VOCAB).float() - 1.0).pow(2).mean().sqrt()


def test_a_loss_micro_batches_cannot_add_up_is_named_when_planning() -> None:
    w = _lm_workload(_rms)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=2)
    said = [str(c.message) for c in caught if "micro-batch" in str(c.message)]
    assert said and "'sqrt'" in said[0] and "averaged" in said[0]
    assert plan.options["microbatch_loss"]["exact"] is False
    one = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=1)
    assert "microbatch_loss" not in one.options or one.options["microbatch_loss"]["exact"]


def test_micro_batches_of_one_sample_make_the_full_batch_step() -> None:
    """One sample per micro-batch: its size-1 batch dim folds away in the micro-batch's
    program, so the reductions are found on the whole batch's and matched by place."""
    w = _lm_workload(_ce)
    plan = _plan(w, "local:2", method="megatron:dp=1,tp=1,pp=2", microbatches=BATCH)
    assert plan.options["microbatch_loss"]["exact"]
    data = _batches(w, 2)
    _check(_train(w, plan, data), full_batch_reference(w, data))


def test_finding_the_reductions_does_not_trace_the_whole_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one sample's program hides the batch, two samples' shows it as the whole batch's
    does: the plan's check traces no more than that (the count search traced it already when
    it tried two samples per micro-batch; the whole batch of a large model takes seconds)."""
    import meshplan.api as api
    sizes = []
    monkeypatch.setattr(api, "capture",
                        lambda m, f, b: sizes.append(batch_size(b)) or capture(m, f, b))
    w = _lm_workload(_ce)
    plan = _plan(w, "local:2", method="megatron:dp=1,tp=1,pp=2", microbatches=BATCH)
    assert plan.options["microbatch_loss"]["exact"]
    assert BATCH not in sizes and 2 in sizes


def test_strided_batch_pieces_are_counted() -> None:
    """Inputs and targets as shifted views of one token tensor (strided, as a data pipeline
    makes them): the micro-batches' real targets are still counted."""
    w = _lm_workload(_ce)
    plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=4)
    data = []
    for i in range(2):
        g = torch.Generator().manual_seed(30 + i)
        seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        seq[:BATCH // 2, SEQ // 2:] = -100   # padding in the first micro-batches only
        data.append(((seq[:, :-1].clamp(min=0),), seq[:, 1:]))
    assert not data[0][1].is_contiguous()
    _check(_train(w, plan, data), full_batch_reference(w, data))


def _empty_micro_batches(w: Workload, n: int) -> list:
    """Batches whose last quarter of rows has no real target: with 4 micro-batches, one of
    them holds none (its count is 0, the whole batch's is not)."""
    out = []
    for (ids,), labels in _batches(w, n):
        labels = labels.clone()
        labels[-BATCH // 4:] = -100
        out.append(((ids,), labels))
    return out


@pytest.mark.parametrize("loss", ["ce", "weighted", "masked"])
@pytest.mark.parametrize("shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_a_micro_batch_without_real_targets(loss: str, shape) -> None:
    """A micro-batch of padding only adds nothing (not 0/0: NaN), under the vocabulary split
    of Megatron's cross-entropy too, whose NLL keeps its loss per row when the loss asks so."""
    w = _lm_workload(LOSSES[loss])
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # every op of the loss has its signature
        plan = _plan(w, f"local:{shape[0] * shape[1]}", mesh_shape=shape, method="megatron",
                     alpha=(1.0, 1.0), beta=(1.0, 1.0), microbatches=4)
    assert next(o for o in plan.ops if o.op == "nll_loss").strategy.startswith("c:S1")
    data = _empty_micro_batches(w, 2)
    _check(_train(w, plan, data), full_batch_reference(w, data))


def test_a_hugging_face_micro_batch_without_real_targets() -> None:
    w = _hf("llama")
    plan = _plan(w, "local:2", method="zero3", mesh_shape=(1, 2), microbatches=4)
    data = _hf_batches(w, 2)
    for b in data:
        b["labels"][-BATCH // 4:] = -100
    _check(_train(w, plan, data), full_batch_reference(w, data))


def test_a_statistic_of_the_data_in_a_pipeline() -> None:
    """The masked mean's count lives in the last stage; every micro-batch there divides by
    the whole batch's."""
    w = _lm_workload(_masked_mean)
    plan = _plan(w, "local:4", method="megatron:dp=1,tp=2,pp=2", microbatches=4)
    assert plan.num_stages == 2 and plan.options["microbatch_loss"]["exact"]
    data = _empty_micro_batches(w, 2)
    _check(_train(w, plan, data), full_batch_reference(w, data))


class _MixesSamples(nn.Module):
    """A layer whose every output row reads the whole batch: batch norm in training mode
    (statistics over batch and space), or a softmax over the batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4, track_running_stats=False)   # no buffer updates
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h = self.norm(h) if self.how == "batch_norm" else h * torch.softmax(h, dim=0)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("how,op", [("batch_norm", "'batch_norm'"), ("softmax", "'softmax'")])
@pytest.mark.parametrize("microbatches", [2, 8])
def test_a_layer_that_mixes_the_samples_makes_the_step_inexact(how: str, op: str,
                                                               microbatches: int) -> None:
    """Each micro-batch's statistics are its own samples', not the whole batch's: no scaling
    of the loss makes that the full batch's step, and planning says so (eight micro-batches:
    one sample each, the batch dim of size 1)."""
    model = _MixesSamples(how)
    w = Workload(model, nn.CrossEntropyLoss(),
                 ((torch.randn(8, 3, 6, 6),), torch.randint(0, 5, (8,))), how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=microbatches)
    said = [str(c.message) for c in caught if "micro-batch" in str(c.message)]
    assert said and op in said[0] and "whole batch" in said[0], said
    assert plan.options["microbatch_loss"]["exact"] is False
    assert [c.filename for c in caught if "micro-batch" in str(c.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=1)
    assert "microbatch_loss" not in one.options


def test_a_data_statistic_no_sum_mean_max_or_min_makes_the_step_inexact() -> None:
    # A median over the batch is no combination of its micro-batches' medians.
    def by_median(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _ce(out, t) / (t != -100).float().sum(1).median()
    w = _lm_workload(by_median)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=2)
    assert plan.options["microbatch_loss"]["exact"] is False
    assert "'div'" in plan.options["microbatch_loss"]["why"], caught


def test_a_regression_weighted_by_the_data() -> None:
    """Per-element squared errors (mse_loss's "none", split with the batch) weighted by a mask
    of the targets and divided by its sum: a statistic of the data again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        w = (t[:, :1] > 0).float()
        return (F.mse_loss(out, t, reduction="none") * w).sum() / w.sum().clamp(min=1)

    g = torch.Generator().manual_seed(4)
    data = [((torch.randn(8, 8, generator=g),), torch.randn(8, 4, generator=g))
            for _ in range(3)]
    w = Workload(model, loss, data[0], "weighted-mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = _plan(w, "local:2", mesh_shape=(1, 2), method="data", microbatches=4)
    assert next(o for o in plan.ops if o.op == "mse_loss").strategy != "replicated"
    _check(_train(w, plan, data), full_batch_reference(w, data))


def test_the_few_sample_program_is_one_the_search_traced(monkeypatch) -> None:
    """A one-sample micro-batch hides its batch, so its loss's reductions are read from a
    program of a few samples: one the count search traced already when there is one (the
    fewest samples above one), else two samples, traced once."""
    from meshplan import api
    from meshplan.zoo.spec import build_workload
    w = build_workload("gpt:hidden=32,layers=1,heads=2,seq=8,vocab=64,batch=12", device="meta")
    cut = split_microbatches(w.example_batch, 4)[0]   # 3 samples
    three = capture(w.model, w.loss_fn, cut)[1]
    traced = []
    monkeypatch.setattr("meshplan.capture.to_ir._capture_now",
                        lambda *a: traced.append(a) or (None, "a new trace"))
    assert api._few_samples_program(w.model, w.loss_fn, w.example_batch) is three
    assert not traced
    other = build_workload("gpt:hidden=32,layers=1,heads=2,seq=8,vocab=64,batch=12",
                           device="meta")
    assert api._few_samples_program(other.model, other.loss_fn, other.example_batch) == \
        "a new trace"
    assert batch_size(traced[0][2]) == 2
