"""Planning leaves the user's model as it was (issue 25.2): after ``meshplan.plan`` every
parameter and buffer is the same object with the same values, ``requires_grad``, hooks and
training mode are unchanged — for the zoo, Hugging Face models, a module registered under two
names, a parameter two modules share, registered buffers and a model on the meta device — and
such models then train equal to one device (emulated ranks and gloo)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn

import meshplan
from meshplan.capture.to_ir import capture
from meshplan.runtime.emulated import run_emulated
from meshplan.zoo.catalog import KIND_FIELDS
from meshplan.zoo.spec import Workload, build_workload
from oracle import SGD, assert_matches, batches, reference, train_rank
from test_hf_models import MODELS as HF_MODELS, batch as hf_batch, build as build_hf


class _FF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.ff(x))


class Reused(nn.Module):
    """A block registered under two names (``blocks.0`` and ``again``), a weight two modules
    share (``head.weight`` is ``tail.weight``) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        block = _FF()
        self.blocks = nn.ModuleList([block, _FF()])
        self.again = block
        self.head = nn.Linear(8, 8)
        self.tail = nn.Linear(8, 4, bias=False)
        self.tail.weight = nn.Parameter(self.head.weight[:4].detach().clone())
        self.head2 = nn.Linear(8, 4, bias=False)
        self.head2.weight = self.tail.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.again(self.blocks[1](self.blocks[0](x) * self.scale))
        return self.tail(self.head(h)) + self.head2(h)


def _reused() -> Workload:
    torch.manual_seed(0)
    return Workload(Reused(), nn.functional.mse_loss,
                    ((torch.randn(8, 8),), torch.randn(8, 4)), "reused")


def _fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything planning must not change: each slot's object and a checksum of its bytes,
    requires_grad, hooks, training mode."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        data = t.detach()
        digest = "meta" if data.is_meta else hashlib.sha1(
            data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        out[name] = (id(t), type(t).__name__, t.requires_grad, digest, tuple(t.shape))
    out["#modules"] = [(n, id(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks),
                        len(m._backward_hooks)) for n, m in model.named_modules(
                            remove_duplicate=False)]
    out["#param_hooks"] = [(n, len(getattr(p, "_backward_hooks", None) or {}))
                           for n, p in model.named_parameters(remove_duplicate=False)]
    return out


def _zoo_spec(kind: str) -> str:
    small = {"mlp": "mlp:layers=2,hidden=8,batch=4",
             "gpt": "gpt:hidden=16,layers=2,heads=2,seq=8,vocab=32,batch=4",
             "bert": "bert:hidden=16,layers=2,heads=2,seq=8,vocab=32,batch=4",
             "moe": "moe:hidden=16,layers=2,heads=2,experts=4,seq=8,vocab=32,batch=4",
             "wresnet": "wresnet:layers=26,channels=4,width=1,image=8,classes=4,batch=4",
             "vgg19": "vgg19:channels=4,fc=16,image=32,classes=4,batch=2",
             "vit": "vit:hidden=16,layers=2,heads=2,patch=4,image=8,classes=4,batch=4"}
    return small[kind]


@pytest.mark.parametrize("kind", list(KIND_FIELDS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_planning_leaves_a_zoo_model_as_it_was(kind: str, device: str) -> None:
    w = build_workload(_zoo_spec(kind), device=device, seed=0)
    w.model.eval() if kind == "mlp" else None    # a mode that is not the default stays
    hook = w.model.register_forward_hook(lambda *a: None)
    before = _fingerprint(w.model)
    meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:2", mesh_shape=(1, 2),
                  method="data", memory_budget_gb=0)
    assert _fingerprint(w.model) == before
    hook.remove()


@pytest.mark.parametrize("name", HF_MODELS)
def test_planning_leaves_a_hugging_face_model_as_it_was(name: str) -> None:
    model = build_hf(name)
    before = _fingerprint(model)
    meshplan.plan(model, None, "adamw", hf_batch(name, 0), "local:2", mesh_shape=(1, 2),
                  method="data", memory_budget_gb=0)
    assert _fingerprint(model) == before


def test_a_reused_module_and_a_shared_weight_plan_untouched_and_train_exactly() -> None:
    w = _reused()
    before = _fingerprint(w.model)
    plans = {m: meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:4",
                              mesh_shape=shape, method=m, memory_budget_gb=0)
             for m, shape in (("data", (1, 4)), ("zero3", (2, 2)), ("intra-only", (2, 2)))}
    assert _fingerprint(w.model) == before
    data = batches(w, 3)
    ref = reference(w, SGD, data)
    captured = capture(w.model, w.loss_fn, w.example_batch)
    for plan in plans.values():
        for result in run_emulated(train_rank, plan.mesh_shape, plan, w, data, captured):
            assert_matches(result, ref, plan, SGD)
    assert _fingerprint(w.model) == before   # training a copy of the state, not the model


def _gloo_reused(rank: int, nprocs: int, plan, data) -> tuple:
    from meshplan.runtime.comm import ProcessGroupComm
    w = _reused()
    return train_rank(ProcessGroupComm(plan.mesh_shape), plan, w, data)


def test_a_reused_module_trains_exactly_on_gloo(pool2) -> None:
    w = _reused()
    plan = meshplan.plan(w.model, w.loss_fn, SGD, w.example_batch, "local:2",
                         mesh_shape=(1, 2), method="zero3", memory_budget_gb=0)
    data = batches(w, 3)
    ref = reference(w, SGD, data)
    for result in pool2.run(_gloo_reused, plan, data):
        assert_matches(result, ref, plan, SGD)
