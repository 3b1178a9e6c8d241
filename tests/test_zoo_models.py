"""Tests for the issue-3 zoo: presets, MoE transformer, Wide-ResNet, VGG19, ViT, BERT."""

from __future__ import annotations

import math
import resource
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from meshplan.capture.to_ir import capture
from meshplan.zoo import gpt, moe, vgg, vit, wresnet
from meshplan.zoo.catalog import PRESETS
from meshplan.zoo.moe_layer import MoELayer, capacity_slots
from meshplan.zoo.spec import ModelSpec, Workload, build_workload, describe_zoo, parse_model_spec

TINY = {
    "moe": "moe:hidden=16,layers=4,heads=2,experts=4,seq=8,vocab=40,batch=3,capacity=1.0,expert_ffn=2",
    "wresnet": "wresnet:layers=26,channels=4,width=2,image=32,classes=7,batch=3",
    "vgg19": "vgg19:channels=4,fc=16,image=32,classes=10,batch=2",
    "vit": "vit:hidden=16,layers=2,heads=2,patch=8,image=32,classes=10,batch=2",
    "bert": "bert:hidden=16,layers=2,heads=2,seq=8,vocab=30,batch=2",
}


def _loss(w: Workload) -> Tensor:
    inputs, target = w.example_batch
    return w.loss_fn(w.model(*inputs), target)


def _num_params(w: Workload) -> int:
    return sum(p.numel() for p in w.model.parameters())


# ---------------------------------------------------------------- presets and specs


def test_presets_expand_and_combine_with_batch_and_overrides() -> None:
    spec = parse_model_spec("gpt:preset=39b,batch=1024")
    assert str(spec) == "gpt:hidden=8192,layers=48,heads=64,seq=1024,vocab=51200,batch=1024"
    assert parse_model_spec(str(spec)) == spec
    # An explicit field wins wherever the preset stands; names are case-insensitive.
    assert parse_model_spec("gpt:layers=2,preset=1.3B") == parse_model_spec(
        "gpt:hidden=2048,layers=2,heads=32,seq=1024,vocab=51200")
    mega = parse_model_spec("gpt:preset=145.6b")
    assert [mega.get(n) for n in ("hidden", "layers", "heads", "seq", "vocab")] == [12288, 80, 96, 2048, 51200]
    assert parse_model_spec("gpt:preset=1t").get("hidden") == 25600
    moe_spec = parse_model_spec("moe:preset=70b")
    assert [moe_spec.get(n) for n in ("hidden", "layers", "heads", "experts", "seq", "vocab")] == [
        2048, 32, 16, 64, 1024, 32000]
    assert moe_spec.get("capacity") == 2.0 and moe_spec.get("expert_ffn") == 8
    wide = parse_model_spec("wresnet:preset=13b,batch=1536")
    assert [wide.get(n) for n in ("layers", "channels", "width", "image", "classes", "batch")] == [
        101, 320, 16, 224, 1024, 1536]
    assert parse_model_spec("bert:preset=base") == parse_model_spec("bert")
    assert set(PRESETS["gpt"]) == {"350m", "760m", "1.3b", "2.6b", "6.7b", "15b", "39b",
                                    "1.7b", "7.5b", "39.1b", "145.6b", "1t"}
    assert set(PRESETS["moe"]) == {"380m", "690m", "1.3b", "2.4b", "10b", "27b", "70b"}
    assert set(PRESETS["wresnet"]) == {"250m", "500m", "1b", "2b", "4b", "6.8b", "13b"}


def test_capacity_is_a_float_field() -> None:
    spec = parse_model_spec("moe:capacity=2")
    assert spec.get("capacity") == 2.0 and isinstance(spec.get("capacity"), float)
    assert spec == ModelSpec("moe", (("capacity", 2),)) == parse_model_spec("moe:capacity=2.0")
    half = parse_model_spec("moe:capacity=0.25")
    assert "capacity=0.25" in str(half) and parse_model_spec(str(half)) == half


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("gpt:preset=40b", r"unknown gpt preset '40b'; valid presets: 350m\|760m\|1.3b.*\|1t"),
        ("moe:preset=1t", r"unknown moe preset '1t'; valid presets: 380m\|690m"),
        ("vit:preset=base", r"model kind 'vit' has no presets; kinds with presets: gpt, moe, wresnet, bert"),
        ("gpt:preset=39b,preset=15b", r"preset given 2 times"),
        ("gpt:preset=39b,layers=2,layers=3", r"field 'layers' given twice"),
        ("moe:capacity=abc", r"field 'capacity'.*must be a number, got 'abc'"),
        ("moe:capacity=0", r"'capacity' must be a finite number > 0, got 0.0"),
        ("moe:capacity=inf", r"'capacity' must be a finite number > 0"),
        ("moe:experts=2.5", r"field 'experts'.*must be an integer, got '2.5'"),
        ("wresnet:depth=50", r"unknown field 'depth'.*layers \(default 26\).*preset=250m\|500m"),
        ("vgg:channels=8", r"unknown model kind 'vgg'.*vgg19:channels=64.*vit:hidden=768"),
    ],
)
def test_spec_errors(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        parse_model_spec(text)


def test_describe_zoo_lists_every_kind_with_fields_and_presets() -> None:
    text = describe_zoo()
    for kind in ("mlp:", "gpt:", "bert:", "moe:", "wresnet:", "vgg19:", "vit:"):
        assert kind in text
    assert "capacity=2.0" in text and "expert_ffn=8" in text and "presets 350m|760m" in text
    assert "wresnet:layers=26,channels=8,width=2,image=32,classes=10,batch=4 (presets 250m|" in text


@pytest.mark.parametrize(
    ("text", "error", "pattern"),
    [
        ("moe:hidden=30,heads=4", ValueError, "MoEConfig.hidden=30 is not divisible by num_heads=4"),
        ("vit:hidden=30,heads=4", ValueError, "ViTConfig.hidden=30 is not divisible by num_heads=4"),
        ("vit:image=30,patch=4", ValueError, "ViTConfig.image=30 is not divisible by patch=4"),
        ("wresnet:layers=34", ValueError, r"num_layers=34 is not a known depth; valid depths: \[26, 50, 101\]"),
        ("vgg19:image=16", ValueError, "VGGConfig.image=16 is too small"),
        ("bert:hidden=32,heads=5", ValueError, "not divisible by num_heads=5"),
    ],
)
def test_build_errors(text: str, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        build_workload(text)


def test_config_type_errors() -> None:
    with pytest.raises(TypeError, match="MoEConfig.capacity must be a number"):
        moe.MoEConfig(16, 2, 2, 4, 8, 10, capacity="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MoEConfig.capacity must be a finite number > 0"):
        moe.MoEConfig(16, 2, 2, 4, 8, 10, capacity=-1.0)
    with pytest.raises(TypeError, match="MoEConfig.num_experts must be an int"):
        moe.MoEConfig(16, 2, 2, True, 8, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WResNetConfig.width must be an int"):
        wresnet.WResNetConfig(26, 8, 2.0, 32, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a VGGConfig"):
        vgg.VGG19(vit.ViTConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity must be > 0"):
        capacity_slots(0.0, 8, 4)


# ---------------------------------------------------------------- every model: cpu, seeds, meta


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tiny_models_train_on_cpu_deterministically(kind: str) -> None:
    torch.manual_seed(99)
    rng = torch.get_rng_state()
    a, b = build_workload(TINY[kind], device="cpu", seed=4), build_workload(TINY[kind], device="cpu", seed=4)
    assert torch.equal(torch.get_rng_state(), rng)
    for x, y in zip([*a.model.state_dict().values(), *a.example_batch[0]],
                    [*b.model.state_dict().values(), *b.example_batch[0]], strict=True):
        assert torch.equal(x, y)
    loss = _loss(a)
    # At initialisation every model predicts nearly uniformly over its classes / vocabulary.
    num_classes = parse_model_spec(TINY[kind]).as_dict().get("classes") or parse_model_spec(TINY[kind]).get("vocab")
    assert loss.dim() == 0 and abs(loss.item() - math.log(num_classes)) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.model.parameters())
    assert list(a.model.buffers()) == [], "no running statistics or other mutable state"


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tiny_models_capture_without_unsupported_ops(kind: str) -> None:
    w = build_workload(TINY[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a dimension signature warns
        _, graph = capture(w.model, w.loss_fn, w.example_batch)
    assert len(graph.nodes) > 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpt:preset=1t,batch=8", 1_008_038_758_400),
        ("moe:preset=70b,batch=8", 69_882_515_456),
        ("wresnet:preset=13b,batch=8", 12_633_386_944),
        ("vgg19", 139_611_210),  # torchvision's vgg19 with a 10-class head
        ("vit", 85_150_474),
        ("bert:preset=base", 108_595_200),
    ],
)
def test_biggest_presets_build_on_meta_without_allocating(text: str, expected: int) -> None:
    # torch imports its compiler stack on the first meta init (1-3 s, once per process).
    build_workload("gpt:hidden=8,layers=1,heads=1,seq=4,vocab=16,batch=2")
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()   # CPU seconds: a busy machine's wall clock is no measure
    w = build_workload(text)
    elapsed = time.process_time() - start
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib) / 1024
    assert elapsed < 5.0
    assert rss_growth_mib < 200
    assert all(t.is_meta for t in [*w.model.parameters(), *w.example_batch[0], w.example_batch[1]])
    assert _num_params(w) == expected


def _closed_form(w: Workload) -> int:
    model = w.model
    counters = {gpt.GPT: gpt.num_params, moe.MoETransformer: moe.num_params, wresnet.WideResNet: wresnet.num_params,
                vgg.VGG19: vgg.num_params, vit.ViT: vit.num_params}
    return counters[type(model)](model.config)


@pytest.mark.parametrize("kind", ["gpt", "moe", "wresnet"])
def test_every_preset_matches_its_closed_form_and_name(kind: str) -> None:
    for name in PRESETS[kind]:
        w = build_workload(f"{kind}:preset={name}")
        total = _num_params(w)
        assert total == _closed_form(w)
        named = float(name[:-1]) * (1e9 if name[-1] == "b" else 1e6 if name[-1] == "m" else 1e12)
        assert abs(total / named - 1) < 0.05, (name, total)


@pytest.mark.parametrize(
    "text",
    [*TINY.values(), "moe:layers=5,experts=3,expert_ffn=3", "wresnet:layers=50,channels=3,width=3",
     "wresnet:layers=101,channels=2,width=1", "vgg19:channels=2,fc=5,image=64", "vit:hidden=8,heads=4,patch=2"],
)
def test_closed_form_param_counts_on_small_configs(text: str) -> None:
    w = build_workload(text)
    assert _num_params(w) == _closed_form(w)


# ---------------------------------------------------------------- MoE


def _expert(layer: MoELayer, e: int, v: Tensor) -> Tensor:
    return F.gelu(v @ layer.w_in[e] + layer.b_in[e]) @ layer.w_out[e] + layer.b_out[e]


def _reference_moe(layer: MoELayer, x: Tensor) -> tuple[Tensor, list[tuple[int, int, int]]]:
    """Route token by token; return the output and (group, token, number of kept choices)."""
    num_groups, num_tokens, _ = x.shape
    num_experts = layer.wg.shape[1]
    slots = capacity_slots(layer.capacity, num_tokens, num_experts)
    y, kept = torch.zeros_like(x), []
    for g in range(num_groups):
        probs = [torch.softmax(x[g, t] @ layer.wg, -1) for t in range(num_tokens)]
        first = [int(p.argmax()) for p in probs]
        second = [int(torch.where(torch.arange(num_experts) == e, -1.0, p).argmax()) for p, e in zip(probs, first)]
        fill = [0] * num_experts
        slot1 = []
        for e in first:
            slot1.append(fill[e])
            fill[e] += 1
        slot2 = []  # second choices queue behind every first choice of the group
        for e in second:
            slot2.append(fill[e])
            fill[e] += 1
        for t in range(num_tokens):
            g1 = probs[t][first[t]] * (slot1[t] < slots)
            g2 = probs[t][second[t]] * (slot2[t] < slots)
            norm = g1 + g2 + 1e-9
            for gate, e, s in ((g1, first[t], slot1[t]), (g2, second[t], slot2[t])):
                if s < slots:
                    y[g, t] += gate / norm * _expert(layer, e, x[g, t])
            kept.append((g, t, int(slot1[t] < slots) + int(slot2[t] < slots)))
    return y, kept


def _float64_layer(capacity: float, seed: int) -> tuple[MoELayer, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    layer = MoELayer(hidden=6, ffn_hidden=5, num_experts=4, capacity=capacity).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return layer, torch.randn(3, 10, 6, generator=generator, dtype=torch.float64)


def test_moe_layer_matches_per_token_reference_and_drops_over_capacity() -> None:
    layer, x = _float64_layer(capacity=0.5, seed=0)  # C = int(0.5 * 2 * 10 / 4) = 2 slots
    assert capacity_slots(0.5, 10, 4) == 2
    with torch.no_grad():
        y = layer(x)
        expected, kept = _reference_moe(layer, x)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    counts = [k for _, _, k in kept]
    assert counts.count(0) >= 1 and counts.count(1) >= 1 and counts.count(2) >= 1, counts
    for g, t, k in kept:
        if k == 0:
            assert torch.equal(y[g, t], torch.zeros(6, dtype=torch.float64))  # dropped: contributes 0


def test_moe_layer_without_drops_mixes_top2_with_normalised_gates() -> None:
    layer, x = _float64_layer(capacity=4.0, seed=1)  # C = 20 slots: nothing is dropped
    with torch.no_grad():
        y = layer(x)
        expected, kept = _reference_moe(layer, x)
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
        assert all(k == 2 for _, _, k in kept)
        probs = torch.softmax(x[0, 0] @ layer.wg, -1)
        (p1, p2), (e1, e2) = probs.topk(2)
        mixed = (p1 * _expert(layer, int(e1), x[0, 0]) + p2 * _expert(layer, int(e2), x[0, 0])) / (p1 + p2)
    torch.testing.assert_close(y[0, 0], mixed, rtol=1e-8, atol=1e-8)


def test_moe_capacity_is_per_group_so_a_batch_split_drops_the_same_tokens() -> None:
    layer, x = _float64_layer(capacity=0.5, seed=2)
    with torch.no_grad():
        whole = layer(x)
        parts = torch.cat([layer(x[:1]), layer(x[1:])])
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_moe_transformer_alternates_dense_and_moe_blocks() -> None:
    w = build_workload(TINY["moe"], device="cpu", seed=3)
    model = w.model
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and names[-2:] == ["ln_f.weight", "ln_f.bias"]
    assert [f"blocks.{i}.moe.{p}" for i in (1, 3) for p in ("wg", "w_in", "b_in", "w_out", "b_out")] == [
        n for n in names if ".moe." in n]
    assert "blocks.0.mlp.fc_in.weight" in names and "blocks.2.mlp.fc_out.bias" in names
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["blocks.1.moe.wg"] == (16, 4) and shapes["blocks.1.moe.w_in"] == (4, 16, 32)
    assert shapes["blocks.1.moe.w_out"] == (4, 32, 16) and shapes["blocks.3.moe.b_out"] == (4, 16)
    (tokens,), _ = w.example_batch
    with torch.no_grad():
        model.double()
        x = model.wte.weight[tokens] + model.wpe.weight[: tokens.shape[1]]
        for i, block in enumerate(model.blocks):
            if i % 2 == 0:
                x = block(x)
            else:
                x = x + block.attn(block.ln_1(x))
                x = x + _reference_moe(block.moe, block.ln_2(x))[0]
        expected = F.layer_norm(x, (16,), model.ln_f.weight, model.ln_f.bias) @ model.wte.weight.T
        torch.testing.assert_close(model(tokens), expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- Wide-ResNet


def _batch_norm(x: Tensor, bn: torch.nn.BatchNorm2d) -> Tensor:
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    var = x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + bn.eps) * bn.weight[:, None, None] + bn.bias[:, None, None]


def _reference_bottleneck(block: wresnet.Bottleneck, x: Tensor) -> Tensor:
    def conv(c: torch.nn.Conv2d, v: Tensor) -> Tensor:
        return F.conv2d(v, c.weight, stride=c.stride, padding=c.padding)

    y = torch.relu(_batch_norm(conv(block.conv1, x), block.bn1))
    y = torch.relu(_batch_norm(conv(block.conv2, y), block.bn2))
    y = _batch_norm(conv(block.conv3, y), block.bn3)
    shortcut = x if block.proj_conv is None else _batch_norm(conv(block.proj_conv, x), block.proj_bn)
    return torch.relu(shortcut + y)


def test_wresnet_forward_matches_reference_with_batch_statistics() -> None:
    w = build_workload(TINY["wresnet"], device="cpu", seed=5)
    model = w.model.double()
    (images,), _ = w.example_batch
    images = images.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # BN weights away from 1, biases away from 0
        x = torch.relu(_batch_norm(F.conv2d(images, model.stem_conv.weight, stride=2, padding=3), model.stem_bn))
        x = F.max_pool2d(x, 3, stride=2, padding=1)
        for stage in model.stages:
            for block in stage:
                x = _reference_bottleneck(block, x)
        expected = x.mean(dim=(2, 3)) @ model.fc.weight.T + model.fc.bias
        torch.testing.assert_close(model(images), expected, rtol=1e-10, atol=1e-10)
        model.eval()  # no running statistics: eval normalises with batch statistics too
        torch.testing.assert_close(model(images), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("depth", "blocks"), [(26, (2, 2, 2, 2)), (50, (3, 4, 6, 3)), (101, (3, 4, 23, 3))])
def test_wresnet_depth_counts_weight_layers_and_widens_3x3(depth: int, blocks: tuple[int, ...]) -> None:
    w = build_workload(f"wresnet:layers={depth},channels=4,width=3,image=64")
    model = w.model
    assert tuple(len(stage) for stage in model.stages) == blocks
    main_path = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
                 and "proj" not in n]
    assert len(main_path) == depth
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["stem_conv.weight"] == (4, 3, 7, 7)
    assert shapes["stages.2.0.conv2.weight"] == (4 * 4 * 3, 16, 3, 3)  # f = 4c filters, 3x wider
    assert shapes["stages.3.0.proj_conv.weight"] == (4 * 32, 4 * 16, 1, 1)
    assert "stages.0.1.proj_conv.weight" not in shapes and shapes["fc.weight"] == (10, 128)
    (images,), _ = w.example_batch
    assert model(images).shape == (4, 10)  # meta forward: shapes only


def test_wresnet_preset_forward_shapes_on_meta() -> None:
    w = build_workload("wresnet:preset=13b,batch=2")
    assert w.example_batch[0][0].shape == (2, 3, 224, 224)
    assert w.model(*w.example_batch[0]).shape == (2, 1024)


# ---------------------------------------------------------------- VGG19, ViT, BERT


def test_vgg19_layers_and_hap_classifier() -> None:
    w = build_workload("vgg19")
    convs = [m for m in w.model.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in w.model.modules() if isinstance(m, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [64] * 2 + [128] * 2 + [256] * 4 + [512] * 8
    assert [(m.in_features, m.out_features) for m in linears] == [(25088, 4096), (4096, 4096), (4096, 10)]
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Dropout)) for m in w.model.modules())
    for image in (32, 224):  # CIFAR's 1x1 and ImageNet's 7x7 final maps both reach the classifier
        assert w.model(torch.empty(2, 3, image, image, device="meta")).shape == (2, 10)


def test_vgg19_forward_matches_reference() -> None:
    w = build_workload(TINY["vgg19"], device="cpu", seed=6)
    (images,), _ = w.example_batch
    model = w.model
    with torch.no_grad():
        x, convs = images, iter(m for m in model.features if isinstance(m, torch.nn.Conv2d))
        for group in (2, 2, 4, 4, 4):
            for _ in range(group):
                conv = next(convs)
                x = torch.relu(F.conv2d(x, conv.weight, conv.bias, padding=1))
            x = F.max_pool2d(x, 2)
        x = x.expand(-1, -1, 7, 7).flatten(1)  # a 1x1 map pooled to 7x7 is repeated
        fc1, fc2, fc3 = (m for m in model.classifier if isinstance(m, torch.nn.Linear))
        expected = fc3(torch.relu(fc2(torch.relu(fc1(x)))))
        torch.testing.assert_close(model(images), expected, rtol=1e-5, atol=1e-6)


def test_vit_forward_matches_reference_and_attends_both_ways() -> None:
    w = build_workload(TINY["vit"], device="cpu", seed=7)
    model = w.model.double()
    (images,), _ = w.example_batch
    images = images.double()
    b, p, h = images.shape[0], 8, 16
    with torch.no_grad():
        # Patches by reshape instead of a convolution: (b, 3, 4, 8, 4, 8) -> (b, 16 patches, 3*8*8).
        patches = images.reshape(b, 3, 4, p, 4, p).permute(0, 2, 4, 1, 3, 5).reshape(b, 16, 3 * p * p)
        x = patches @ model.patch_embed.weight.reshape(h, -1).T + model.patch_embed.bias + model.pos_embed
        for block in model.blocks:
            x = block(x)
        pooled = F.layer_norm(x, (h,), model.ln_f.weight, model.ln_f.bias).mean(1)
        torch.testing.assert_close(model(images), pooled @ model.head.weight.T + model.head.bias,
                                   rtol=1e-10, atol=1e-10)
        attn = model.blocks[0].attn
        tokens = torch.randn(1, 16, h, dtype=torch.float64)
        changed = tokens.clone()
        changed[:, -1] += 1.0
        assert not torch.allclose(attn(tokens)[:, 0], attn(changed)[:, 0]), "ViT attention is bidirectional"
    assert [n for n, _ in model.named_parameters()][:3] == ["pos_embed", "patch_embed.weight", "patch_embed.bias"]


def test_bert_is_the_gpt_with_hap_sizes() -> None:
    w = build_workload("bert:preset=base,batch=32")
    assert isinstance(w.model, gpt.GPT)
    assert w.model.config == gpt.GPTConfig(hidden=768, num_layers=12, num_heads=12, seq_len=128, vocab_size=30522)
    assert w.model.blocks[0].mlp.fc_in.out_features == 3072
    assert w.example_batch[0][0].shape == (32, 128)
    assert w.name == "bert:hidden=768,layers=12,heads=12,seq=128,vocab=30522,batch=32"
