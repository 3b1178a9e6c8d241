"""Batches and outputs as people write them (``capture/batch.py``): a tensor, a tuple or a dict
of keyword arguments in, a target of a tensor, a tuple or a dict of tensors; a tensor, tuple,
dict or ``ModelOutput`` out; ``loss_fn=None`` when the
model returns its loss. Every form plans and trains like one device on emulated ranks; malformed
batches are refused naming what was wrong and what is valid. Mean cross-entropy with -100
targets and class weights: the count is one planned scalar all-reduce."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.cli import main
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import make_optimizer
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import Workload
from oracle import SGD, assert_matches, train_rank

N, D, C = 8, 16, 64


class Net(nn.Module):
    """Keyword inputs, an optional mask and labels; the output's form is chosen by ``out``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.a, self.b = nn.Linear(D, 32), nn.Linear(32, C)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> Any:
        h = torch.relu(self.a(x))
        if scale is not None:
            h = h * scale.unsqueeze(-1)
        logits = self.b(h)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if self.out == "tensor":
            return logits if loss is None else loss
        if self.out == "tuple":
            return (logits,) if loss is None else (loss, logits)
        return {"logits": logits} | ({} if loss is None else {"loss": loss})


def _data(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (N,), generator=g)
    labels[[1, 4, 5]] = -100
    return {"x": torch.randn(N, D, generator=g), "scale": torch.rand(N, generator=g) + 0.5,
            "labels": labels}


def _logits(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out["logits"] if isinstance(out, dict) else out


def _ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out), target)


# Each form: (output form, loss_fn, batch from the data dict, how one device computes the loss)
FORMS: dict[str, tuple[str, Callable | None, Callable, Callable]] = {
    "tensor-in": ("tensor", _ce, lambda d: (d["x"], d["labels"]),
                  lambda m, d: _ce(m(d["x"]), d["labels"])),
    "tuple-in": ("tuple", _ce, lambda d: ((d["x"], d["scale"]), d["labels"]),
                 lambda m, d: _ce(m(d["x"], d["scale"]), d["labels"])),
    "dict-in-target": ("dict", _ce, lambda d: ({"x": d["x"], "scale": d["scale"]}, d["labels"]),
                       lambda m, d: _ce(m(x=d["x"], scale=d["scale"]), d["labels"])),
    # A target of several tensors, given to the loss in its form (a loss of several heads).
    "tuple-target": ("tensor", lambda out, t: _ce(out, t[0]) + (out.logsumexp(-1) * t[1]).mean(),
                     lambda d: (d["x"], (d["labels"], d["scale"])),
                     lambda m, d: _ce(m(d["x"]), d["labels"])
                     + (m(d["x"]).logsumexp(-1) * d["scale"]).mean()),
    "dict-target": ("tensor", lambda out, t: _ce(out, t["y"]) + (out.mean(-1) * t["w"]).sum(),
                    lambda d: (d["x"], {"y": d["labels"], "w": d["scale"]}),
                    lambda m, d: _ce(m(d["x"]), d["labels"]) + (m(d["x"]).mean(-1)
                                                               * d["scale"]).sum()),
    "kwargs-own-loss-dict": ("dict", None, lambda d: dict(d), lambda m, d: m(**d)["loss"]),
    "kwargs-own-loss-tuple": ("tuple", None, lambda d: dict(d), lambda m, d: m(**d)[0]),
    "kwargs-own-loss-tensor": ("tensor", None, lambda d: dict(d), lambda m, d: m(**d)),
    "kwargs-loss-of-output": ("dict", lambda out: out["loss"] * 2, lambda d: dict(d),
                              lambda m, d: m(**d)["loss"] * 2),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("method,shape", [("data", (1, 4)), ("megatron", (2, 2))])
def test_batch_and_output_forms_train_like_one_device(form: str, method: str, shape) -> None:
    out, loss_fn, make_batch, one_device = FORMS[form]
    torch.manual_seed(0)
    model = Net(out)
    example = make_batch(_data(0))
    plan = api.plan(model, loss_fn, SGD, example, "local:4", mesh_shape=shape, method=method,
                    memory_budget_gb=0)
    data = [make_batch(_data(s)) for s in (1, 2, 3)]
    ref_model = copy.deepcopy(model)
    opt = make_optimizer(SGD, ref_model.parameters())
    losses = []
    for s in (1, 2, 3):
        loss = one_device(ref_model, _data(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref = (losses, {k: v.detach().clone() for k, v in ref_model.named_parameters()})
    w = Workload(model=model, loss_fn=loss_fn, example_batch=example, name=form)
    for result in run_emulated(train_rank, shape, plan, w, data,
                               capture(model, loss_fn, example)):
        assert_matches(result, ref, plan, SGD)


@pytest.mark.parametrize("batch,needles", [
    ((torch.ones(N, D),), ["(inputs, target)", "dict of keyword arguments", "length 1"]),
    ((torch.ones(N, D), [1, 2]), ["target is a list of tensors, but entry '0' is a int",
                                  "tuple or dict of tensors"]),
    ((torch.ones(N, D), {"y": torch.ones(N), "n": 3}), ["target is a dict of tensors, but "
                                                         "entry 'n' is a int"]),
    ((torch.ones(N, D), ()), ["target is a tuple of tensors, but it is empty"]),
    ((torch.ones(N, D), 3.0), ["target is a float"]),
    (((torch.ones(N, D), 3), torch.ones(N)), ["positional input 1 is a int", "not a tensor"]),
    ("x", ["got a str"]),
    ({}, ["no input tensor"]),
    ({1: torch.ones(N, D)}, ["string keys", "1"]),
])
def test_malformed_batches_name_what_is_valid(batch: Any, needles: list[str]) -> None:
    with pytest.raises(TypeError) as err:
        capture(Net("tensor"), _ce, batch)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_loss_fn_none_needs_a_model_that_returns_its_loss() -> None:
    with pytest.raises(ValueError, match="loss_fn is None, so the model must return its loss"):
        capture(Net("dict"), None, {"x": torch.ones(N, D)})
    with pytest.raises(ValueError, match="the batch has a target but loss_fn is None"):
        capture(Net("dict"), None, (torch.ones(N, D), torch.zeros(N, dtype=torch.long)))


def test_a_step_batch_must_have_the_traced_form() -> None:
    from meshplan.runtime.emulated import run_emulated as run
    model = Net("dict")
    example = {"x": torch.ones(N, D), "labels": torch.zeros(N, dtype=torch.long)}
    plan = api.plan(model, None, SGD, example, "local:2", mesh_shape=(1, 2), method="data",
                    memory_budget_gb=0)

    def body(comm: Any, bad: Any) -> None:
        Trainer(plan, model, None, example, comm).step(bad)

    with pytest.raises(Exception, match=r"holds tensors \['x'\].*\['x', 'labels'\]"):
        run(body, (1, 2), {"x": torch.ones(N, D)})


def test_static_keyword_values_are_fixed_at_trace_time() -> None:
    from meshplan.capture.batch import check_static, flatten_batch
    traced, _ = flatten_batch({"x": torch.ones(2), "flag": True})
    check_static(traced, flatten_batch({"x": torch.zeros(2), "flag": True})[0])
    with pytest.raises(ValueError, match="non-tensor keyword inputs"):
        check_static(traced, flatten_batch({"x": torch.zeros(2), "flag": False})[0])


def test_weighted_ignore_index_cross_entropy_under_class_split() -> None:
    # Class weights and -100 targets: the divisor is the weighted count of real targets; under
    # the ILP's class split each rank weighs its own classes and the count is all-reduced.
    torch.manual_seed(0)
    weight = torch.rand(C) + 0.5
    model = Net("tensor")

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, t, weight=weight)

    def batch(s: int) -> Any:
        d = _data(s)
        return (d["x"], d["labels"])

    for shape in ((1, 4), (2, 2)):
        plan = api.plan(model, loss_fn, SGD, batch(0), "local:4", mesh_shape=shape,
                        method="auto", alpha=(1.0, 1.0), beta=(1.0, 1.0), memory_budget_gb=0)
        counts = [c for c in plan.collectives if c.bytes == 4 and c.kind == "all_reduce"]
        assert counts, plan.collectives  # the count's all-reduce is planned
        data = [batch(s) for s in (1, 2, 3)]
        from oracle import reference
        w = Workload(model=model, loss_fn=loss_fn, example_batch=batch(0), name="ce")
        ref = reference(Workload(model=model, loss_fn=loss_fn,
                                 example_batch=((batch(0)[0],), batch(0)[1]), name="ce"),
                        SGD, [((x,), t) for x, t in data])
        for result in run_emulated(train_rank, shape, plan, w, data,
                                   capture(model, loss_fn, batch(0))):
            assert_matches(result, ref, plan, SGD)


USER_FILE = """
import torch
from torch import nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
    def forward(self, input_ids, labels):
        return {"loss": F.cross_entropy(self.a(input_ids), labels)}

def make():
    labels = torch.randint(0, 32, (8,))
    labels[:2] = -100
    return Net(), None, {"input_ids": torch.randn(8, 16), "labels": labels}
"""


def test_cli_file_model_returning_its_loss_and_a_kwargs_batch(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hf_like.py"
    path.write_text(USER_FILE)
    code = main(["plan", f"{path}:make", "--cluster", "local:4", "--method", "data", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    kinds = [(c["kind"], c["bytes"]) for c in doc["collectives"]]
    assert ("all_reduce", 4) in kinds, kinds  # the -100 count, planned


class Nested(nn.Module):
    """Inputs nested as a multimodal loader gives them: a tuple of two positional tensors,
    and a dict of tensors with a static flag beside them, as keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(D, 32), nn.Linear(D, 32), nn.Linear(32, C)

    def forward(self, pair: tuple, text: dict) -> torch.Tensor:
        x, y = pair
        h = torch.relu(self.a(x) + self.b(y))
        if text["gate"]:
            h = h * text["scale"].unsqueeze(-1)
        return self.out(h)


def _nested_batch(seed: int) -> Any:
    d = _data(seed)
    return ({"pair": (d["x"], d["x"].flip(0)), "text": {"scale": d["scale"], "gate": True}},
            {"y": d["labels"]})


@pytest.mark.parametrize("method,shape", [("data", (1, 4)), ("megatron", (2, 2))])
def test_nested_inputs_and_targets_train_like_one_device(method: str, shape) -> None:
    torch.manual_seed(0)
    model = Nested()
    loss_fn = lambda out, t: _ce(out, t["y"])   # noqa: E731
    example = _nested_batch(0)
    plan = api.plan(model, loss_fn, SGD, example, "local:4", mesh_shape=shape, method=method,
                    memory_budget_gb=0)
    data = [_nested_batch(s) for s in (1, 2, 3)]
    ref_model = copy.deepcopy(model)
    opt = make_optimizer(SGD, ref_model.parameters())
    losses = []
    for inputs, target in data:
        loss = loss_fn(ref_model(**inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref = (losses, {k: v.detach().clone() for k, v in ref_model.named_parameters()})
    w = Workload(model=model, loss_fn=loss_fn, example_batch=example, name="nested")
    for result in run_emulated(train_rank, shape, plan, w, data,
                               capture(model, loss_fn, example)):
        assert_matches(result, ref, plan, SGD)
