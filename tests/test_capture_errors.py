"""Capture never ends in a raw traceback: data-dependent shapes get a clear error naming the op
and the module; capture from several threads at once works (emulated ranks)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.capture.to_ir import capture
from meshplan.ir.signatures import signature_fits
from meshplan.capture.signature_rules import OpCall, view_rule


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)


class DroplessMoE(nn.Module):
    """Mixtral-style dropless routing: the tokens of each expert found with ``nonzero``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


class MaskIndexing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[h > 0].sum() * torch.ones_like(x)


def test_data_dependent_shape_names_op_module_and_remedy() -> None:
    x, t = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"nonzero.*DroplessMoE.*capacity-based MoE"):
        capture(DroplessMoE(), F.mse_loss, ((x,), t))


def test_boolean_mask_indexing_is_a_clear_error() -> None:
    x, t = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"cannot trace aten op .*depends on the values"):
        capture(MaskIndexing(), F.mse_loss, ((x,), t))


def test_a_model_bug_is_a_value_error_naming_op_and_module() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).view(5, -1)

    with pytest.raises(ValueError, match=r"view.*runs eagerly"):
        capture(Bad(), lambda o, t: o.sum(), ((torch.randn(6, 8),), torch.zeros(())))


@pytest.mark.parametrize("shared", [True, False], ids=["one-model", "a-model-each"])
def test_capture_from_four_threads_at_once(shared: bool) -> None:
    # One shared model (emulated ranks: one trace, reused) or one model per thread (four
    # traces, serialized).
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(4)]
    batch = ((torch.randn(4, 8),), torch.randn(4, 8))
    results, errors = [], []
    start = threading.Barrier(4)

    def run(k: int) -> None:
        try:
            start.wait()
            results.append(capture(models[0 if shared else k], F.mse_loss, batch)[1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len({g.fingerprint() for g in results}) == 1 and len(results) == 4


def test_view_with_a_unit_dim_inside_a_merged_block_is_signed() -> None:
    # (4, 8) -> (2, 1, 4, 4): every atom sized, the signature fits (was replicated).
    r = view_rule(OpCall("view", ((4, 8),), (2, 1, 4, 4), (None, [2, 1, 4, 4]), ()))
    assert signature_fits(r.sig, ((4, 8),), (2, 1, 4, 4))


class GroupedMM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
        return torch._grouped_mm(x, self.experts, offs=offsets)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return h * 2 if h.sum() > 0 else h


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_an_op_refusing_fake_float32_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"_grouped_mm.*GroupedMM.*plain equivalent"):
        capture(GroupedMM(), lambda o, t: o.sum(), ((torch.randn(8, 8),), torch.zeros(())))


def test_reading_a_tensor_value_in_python_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"Branchy.*test_capture_errors.py:\d+.*value in Python"):
        capture(Branchy(), lambda o, t: o.sum(), ((torch.randn(8, 8),), torch.zeros(())))


def test_reading_dropouts_mask_is_a_clear_error() -> None:
    class MaskReader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, mask = torch.ops.aten.native_dropout(self.lin(x), 0.5, True)
            return out * mask

    with pytest.raises(ValueError, match="mask of aten.native_dropout"):
        capture(MaskReader(), lambda o, t: o.sum(), ((torch.randn(4, 8),), torch.zeros(())))


def test_a_forward_that_writes_into_a_parameter_is_a_clear_error() -> None:
    # nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place, in the forward.
    model = nn.Sequential(nn.Embedding(20, 6, max_norm=1.0), nn.Flatten(), nn.Linear(30, 4))
    with pytest.raises(ValueError, match=r"writes into a parameter in place .*Drop max_norm"):
        capture(model, F.cross_entropy, ((torch.randint(0, 20, (8, 5)),),
                                         torch.randint(0, 4, (8,))))


@pytest.mark.parametrize("hook", ["tensor", "accumulated", "module", "module-pre", "global"])
def test_a_gradient_hook_is_a_clear_error(hook: str) -> None:
    """One device runs a gradient hook (a clamp, a scale) on the gradient; the ranks' traced
    program never passes it, and trained silently differently (step 2's loss 1.3749 against
    one device's 1.3726 with a clamp on one weight)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    handle = {"tensor": lambda: model[0].weight.register_hook(lambda g: g.clamp(-1, 1)),
              "accumulated": lambda: model[2].bias.register_post_accumulate_grad_hook(
                  lambda p: None),
              "module": lambda: model[2].register_full_backward_hook(lambda m, gi, go: None),
              "module-pre": lambda: model[2].register_full_backward_pre_hook(lambda m, g: None),
              "global": lambda: nn.modules.module.register_module_full_backward_hook(
                  lambda m, gi, go: None)}[hook]()
    batch = ((torch.randn(8, 8),), torch.randint(0, 4, (8,)))
    try:
        with pytest.raises(ValueError, match=r"(gradient|backward) hook .*Remove it"):
            capture(model, F.cross_entropy, batch)
    finally:
        handle.remove()
    capture(model, F.cross_entropy, batch)   # without it, traced
