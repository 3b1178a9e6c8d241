"""Tests for meshplan.zoo: MLP and GPT models, model specs, workloads and user model files."""

from __future__ import annotations

import math
import resource
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from meshplan.zoo import gpt, mlp
from meshplan.zoo.spec import ModelSpec, Workload, build_workload, parse_model_spec

TINY_GPT = gpt.GPTConfig(hidden=32, num_layers=2, num_heads=4, seq_len=8, vocab_size=50)


def _loss(w: Workload) -> Tensor:
    inputs, target = w.example_batch
    return w.loss_fn(w.model(*inputs), target)


# ---------------------------------------------------------------- MLP


def test_mlp_parameter_names_and_count() -> None:
    model = mlp.MLP(hidden=6, num_layers=3, bias=True)
    names = [name for name, _ in model.named_parameters()]
    assert names == [f"layers.{i}.{kind}" for i in range(3) for kind in ("weight", "bias")]
    assert sum(p.numel() for p in model.parameters()) == mlp.num_params(6, 3, True) == 3 * (36 + 6)
    no_bias = mlp.MLP(hidden=6, num_layers=3, bias=False)
    assert [n for n, _ in no_bias.named_parameters()] == [f"layers.{i}.weight" for i in range(3)]
    assert sum(p.numel() for p in no_bias.parameters()) == mlp.num_params(6, 3, False) == 108


def test_mlp_forward_has_relu_between_layers_only() -> None:
    torch.manual_seed(0)
    model = mlp.MLP(hidden=5, num_layers=2, bias=True)
    x = torch.randn(7, 5)
    l0, l1 = model.layers
    expected = F.linear(F.relu(F.linear(x, l0.weight, l0.bias)), l1.weight, l1.bias)
    out = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert (out < 0).any(), "no ReLU after the last layer: outputs may be negative"


def test_mlp_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        mlp.MLP(hidden=4, num_layers=0, bias=True)
    with pytest.raises(TypeError, match="hidden"):
        mlp.MLP(hidden=4.0, num_layers=1, bias=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bias"):
        mlp.MLP(hidden=4, num_layers=1, bias=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- GPT


def test_gpt_parameter_names() -> None:
    model = gpt.GPT(gpt.GPTConfig(hidden=8, num_layers=1, num_heads=2, seq_len=4, vocab_size=10))
    block = [
        "ln_1.weight", "ln_1.bias",
        "attn.q_proj.weight", "attn.q_proj.bias", "attn.k_proj.weight", "attn.k_proj.bias",
        "attn.v_proj.weight", "attn.v_proj.bias", "attn.out_proj.weight", "attn.out_proj.bias",
        "ln_2.weight", "ln_2.bias",
        "mlp.fc_in.weight", "mlp.fc_in.bias", "mlp.fc_out.weight", "mlp.fc_out.bias",
    ]
    expected = ["wte.weight", "wpe.weight"] + [f"blocks.0.{n}" for n in block] + ["ln_f.weight", "ln_f.bias"]
    assert [name for name, _ in model.named_parameters()] == expected
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
    assert shapes["wte.weight"] == (10, 8) and shapes["wpe.weight"] == (4, 8)
    assert shapes["blocks.0.mlp.fc_in.weight"] == (32, 8) and shapes["blocks.0.mlp.fc_out.weight"] == (8, 32)


@pytest.mark.parametrize(
    "config",
    [TINY_GPT, gpt.GPTConfig(hidden=12, num_layers=3, num_heads=3, seq_len=5, vocab_size=7)],
)
def test_gpt_num_params_matches_module(config: gpt.GPTConfig) -> None:
    model = gpt.GPT(config)
    assert sum(p.numel() for p in model.parameters()) == gpt.num_params(config)


def _reference_logits(model: gpt.GPT, tokens: Tensor) -> Tensor:
    """The brief's architecture written out with explicit masked softmax and erf GELU."""
    cfg = model.config
    b, s = tokens.shape
    x = model.wte.weight[tokens] + model.wpe.weight[:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for blk in model.blocks:
        a = blk.attn
        y = F.layer_norm(x, (cfg.hidden,), blk.ln_1.weight, blk.ln_1.bias)
        q, k, v = (
            (y @ p.weight.T + p.bias).view(b, s, cfg.num_heads, cfg.head_dim).permute(0, 2, 1, 3)
            for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + att.permute(0, 2, 1, 3).reshape(b, s, cfg.hidden) @ a.out_proj.weight.T + a.out_proj.bias
        y = F.layer_norm(x, (cfg.hidden,), blk.ln_2.weight, blk.ln_2.bias)
        hid = y @ blk.mlp.fc_in.weight.T + blk.mlp.fc_in.bias
        hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))
        x = x + hid @ blk.mlp.fc_out.weight.T + blk.mlp.fc_out.bias
    x = F.layer_norm(x, (cfg.hidden,), model.ln_f.weight, model.ln_f.bias)
    return x @ model.wte.weight.T


def test_gpt_forward_matches_reference_and_is_causal() -> None:
    w = build_workload("gpt:hidden=32,layers=2,heads=4,seq=8,vocab=50,batch=3", device="cpu", seed=1)
    (tokens,), _ = w.example_batch
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        # Re-draw every parameter (LayerNorm included) at O(1) scale: with the 0.02 init, GELU
        # inputs are so small that the tanh approximation would pass for the exact GELU. Float64
        # keeps rounding far below the 1e-4 gap between the two GELUs.
        w.model.double()
        for p in w.model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.5)
        logits = w.model(tokens)
        torch.testing.assert_close(logits, _reference_logits(w.model, tokens), rtol=1e-9, atol=1e-9)
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 50
        later = w.model(changed)
    assert logits.shape == (3, 8, 50)
    torch.testing.assert_close(later[:, :-1], logits[:, :-1], rtol=0, atol=0)
    assert not torch.equal(later[:, -1], logits[:, -1])


def test_gpt_lm_head_is_tied_to_embedding() -> None:
    w = build_workload("gpt:hidden=16,layers=1,heads=2,seq=4,vocab=20,batch=2", device="cpu")
    _loss(w).backward()
    grad = w.model.wte.weight.grad
    assert grad is not None
    # Tokens absent from the batch still get gradient through the tied LM head.
    present = torch.zeros(20, dtype=torch.bool)
    present[w.example_batch[0][0].flatten()] = True
    assert grad[~present].abs().sum() > 0


def test_gpt_loss_at_init_is_near_log_vocab() -> None:
    w = build_workload("gpt:hidden=32,layers=2,heads=4,seq=8,vocab=50,batch=4", device="cpu")
    with torch.no_grad():
        loss = _loss(w).item()
    assert abs(loss - math.log(50)) < 0.3


def test_gpt_config_and_forward_errors() -> None:
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        gpt.GPTConfig(hidden=32, num_layers=1, num_heads=3, seq_len=4, vocab_size=8)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        gpt.GPTConfig(hidden=32, num_layers=1, num_heads=4, seq_len=0, vocab_size=8)
    with pytest.raises(TypeError, match="vocab_size"):
        gpt.GPTConfig(hidden=32, num_layers=1, num_heads=4, seq_len=4, vocab_size="8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GPTConfig"):
        gpt.GPT({"hidden": 32})  # type: ignore[arg-type]
    model = gpt.GPT(TINY_GPT)
    with pytest.raises(ValueError, match="exceeds GPTConfig.seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.zeros(9, dtype=torch.int64))


# ---------------------------------------------------------------- specs


def test_parse_defaults_overrides_and_round_trip() -> None:
    assert parse_model_spec("mlp") == ModelSpec("mlp", (("layers", 2), ("hidden", 64), ("batch", 8), ("bias", 1)))
    spec = parse_model_spec(" mlp: bias=0 , layers=6,hidden=256,batch=32 ")
    assert spec.fields == (("layers", 6), ("hidden", 256), ("batch", 32), ("bias", 0))
    assert str(spec) == "mlp:layers=6,hidden=256,batch=32,bias=0"
    assert parse_model_spec(str(spec)) == spec
    big = parse_model_spec("gpt:hidden=768,layers=12,heads=12,seq=1024,vocab=51200,batch=8")
    assert [big.get(n) for n in ("hidden", "layers", "heads", "seq", "vocab", "batch")] == [768, 12, 12, 1024, 51200, 8]
    assert parse_model_spec("gpt:") == parse_model_spec("gpt") == ModelSpec("gpt")
    assert ModelSpec("gpt", (("layers", 3),)) == parse_model_spec("gpt:layers=3")
    assert hash(ModelSpec("gpt", (("layers", 3),))) == hash(parse_model_spec("gpt:layers=3"))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("resnet:layers=2", r"unknown model kind 'resnet'.*mlp:layers=2,hidden=64,batch=8,bias=1.*gpt:hidden=64"),
        ("", r"unknown model kind ''.*valid kinds"),
        ("mlp:depth=3", r"unknown field 'depth'.*layers \(default 2\), hidden \(default 64\)"),
        ("gpt:hidden=64,dropout=1", r"unknown field 'dropout'.*heads \(default 4\).*vocab \(default 128\)"),
        ("mlp:layers=2.5", r"field 'layers'.*must be an integer, got '2.5'"),
        ("gpt:hidden=", r"field 'hidden'.*must be an integer, got ''"),
        ("mlp:layers", r"field 'layers'.*has no '='.*hidden \(default 64\)"),
        ("mlp:layers=2,,hidden=8", r"field '' .*has no '='"),
        ("mlp:layers=2,layers=3", r"field 'layers' given twice"),
        ("mlp:bias=2", r"'bias' must be 0 or 1, got 2"),
        ("mlp:layers=0", r"'layers' must be >= 1, got 0"),
        ("gpt:vocab=-5", r"'vocab' must be >= 1, got -5"),
    ],
)
def test_parse_errors(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        parse_model_spec(text)


def test_model_spec_direct_construction_errors() -> None:
    with pytest.raises(ValueError, match="unknown model kind 'resnet'"):
        ModelSpec("resnet")
    with pytest.raises(TypeError, match="'hidden' must be an int"):
        ModelSpec("mlp", (("hidden", "64"),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown field 'width'.*valid fields"):
        ModelSpec("mlp").get("width")
    with pytest.raises(TypeError, match="must be a str"):
        parse_model_spec(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- workloads


def test_zoo_workloads_run_forward_and_backward_on_cpu() -> None:
    m = build_workload("mlp:layers=3,hidden=16,batch=5,bias=0", device="cpu")
    (x,), target = m.example_batch
    assert x.shape == target.shape == (5, 16) and x.dtype == target.dtype == torch.float32
    out = m.model(x)
    torch.testing.assert_close(m.loss_fn(out, target), ((out - target) ** 2).mean())
    assert m.name == "mlp:layers=3,hidden=16,batch=5,bias=0"
    g = build_workload("gpt:hidden=16,layers=2,heads=2,seq=6,vocab=30,batch=3", device="cpu")
    (tokens,), target = g.example_batch
    assert tokens.shape == target.shape == (3, 6) and tokens.dtype == target.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 30 and int(target.max()) < 30
    for w in (m, g):
        loss = _loss(w)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None for p in w.model.parameters())


def _state(w: Workload) -> list[Tensor]:
    return [*w.model.state_dict().values(), *w.example_batch[0], w.example_batch[1]]


@pytest.mark.parametrize("text", ["mlp:hidden=8,layers=2", "gpt:hidden=16,layers=1,heads=2,seq=4,vocab=11"])
def test_same_seed_is_bit_identical_and_global_rng_untouched(text: str) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_workload(text, device="cpu", seed=7), build_workload(text, device="cpu", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b), strict=True))
    c = build_workload(text, device="cpu", seed=8)
    assert not all(torch.equal(x, y) for x, y in zip(_state(a), _state(c), strict=True))


def test_meta_build_of_gpt_1_3b_allocates_nothing() -> None:
    # torch imports its compiler stack on the first meta init (1-3 s, once per process).
    build_workload("gpt:hidden=8,layers=1,heads=1,seq=4,vocab=16,batch=2")
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()   # CPU seconds: a busy machine's wall clock is no measure
    w = build_workload("gpt:hidden=2048,layers=24,heads=32,seq=1024,vocab=51200,batch=8")
    elapsed = time.process_time() - start
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib) / 1024
    assert elapsed < 2.0
    assert rss_growth_mib < 200, "a real 1.3B fp32 model would need ~5 GB"
    assert all(p.is_meta for p in w.model.parameters())
    assert all(t.is_meta for t in _state(w))
    config = w.model.config
    total = sum(p.numel() for p in w.model.parameters())
    assert total == gpt.num_params(config) == 1_315_557_376
    assert w.example_batch[0][0].shape == (8, 1024) and w.example_batch[0][0].dtype == torch.int64


def test_build_workload_errors() -> None:
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        build_workload("gpt:hidden=32,heads=3")
    with pytest.raises(ValueError, match=r"device must be one of \('meta', 'cpu'\), got 'cuda'"):
        build_workload("mlp", device="cuda")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        build_workload("mlp", seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        build_workload("mlp", seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str"):
        build_workload(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown model kind 'gtp'.*path/to/file.py:fn"):
        build_workload("gtp:layers=2")


# ---------------------------------------------------------------- user model files

_USER_FILE = '''
from __future__ import annotations
import dataclasses
import torch
from torch import nn
import torch.nn.functional as F

@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int = 4

def make():
    sizes = Sizes()
    model = nn.Sequential(nn.Linear(sizes.width, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(5, sizes.width)
    return model, F.mse_loss, ((x,), torch.randn(5, 2))

def returns_list_inputs():
    model = nn.Linear(2, 2)
    return [model, F.mse_loss, [[torch.ones(1, 2)], torch.zeros(1, 2)]]

def bare_tensor_inputs():
    return nn.Linear(2, 2), F.mse_loss, (torch.ones(1, 2), torch.zeros(1, 2))

def two_items():
    return nn.Linear(2, 2), F.mse_loss

def not_a_module():
    return "model", F.mse_loss, ((torch.ones(1),), torch.ones(1))

def loss_not_callable():
    return nn.Linear(2, 2), 3, ((torch.ones(1, 2),), torch.ones(1, 2))

def bad_target():
    return nn.Linear(2, 2), F.mse_loss, ((torch.ones(1, 2),), [1.0])

def batch_of_three():
    return nn.Linear(2, 2), F.mse_loss, ((torch.ones(1, 2),), torch.ones(1, 2), 0)

def returns_none():
    return None

CONSTANT = 3
'''


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(_USER_FILE)
    return path


def test_file_model_loads_on_cpu_deterministically(model_file: Path) -> None:
    modules_before = set(sys.modules)
    torch.manual_seed(5)
    rng_before = torch.get_rng_state()
    a = build_workload(f"{model_file}:make", device="cpu", seed=3)
    b = build_workload(f" {model_file} : make ", device="cpu", seed=3)
    assert set(sys.modules) == modules_before
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.name == f"{model_file}:make"
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b), strict=True))
    loss = _loss(a)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_file_model_on_meta_and_list_structures(model_file: Path) -> None:
    w = build_workload(f"{model_file}:make")
    assert all(p.is_meta for p in w.model.parameters()) and all(t.is_meta for t in _state(w))
    listy = build_workload(f"{model_file}:returns_list_inputs", device="cpu")
    assert isinstance(listy.example_batch, tuple) and isinstance(listy.example_batch[0], tuple)
    bare = build_workload(f"{model_file}:bare_tensor_inputs", device="cpu")  # one input tensor
    assert isinstance(bare.example_batch[0], torch.Tensor)


@pytest.mark.parametrize(
    ("fn", "pattern"),
    [
        ("two_items", r"returned a tuple of length 2; expected \(model: nn.Module"),
        ("not_a_module", r"returned a model of type str, not an nn.Module"),
        ("loss_not_callable", r"loss_fn of type int, which is not callable"),
        ("bad_target", r"does not fit \(the target is a list of tensors, but entry '0' is a float"),
        ("batch_of_three", r"does not fit \(a batch is \(inputs, target\).*got a tuple of length 3"),
        ("returns_none", r"returned a NoneType; expected"),
        ("missing", r"has no function 'missing'; functions defined there: \['bad_target', .*'make'"),
        ("CONSTANT", r"'CONSTANT' in model file .* is a int, not a function"),
    ],
)
def test_file_model_structure_errors(model_file: Path, fn: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build_workload(f"{model_file}:{fn}")


def test_file_model_spec_errors(model_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build_workload(f"{tmp_path / 'absent.py'}:make")
    with pytest.raises(ValueError, match="must be 'path/to/file.py:fn'"):
        build_workload(str(model_file))
    with pytest.raises(ValueError, match="'2x' .* is not a Python identifier"):
        build_workload(f"{model_file}:2x")
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        build_workload(f"{tmp_path / 'folder.py'}:make")
