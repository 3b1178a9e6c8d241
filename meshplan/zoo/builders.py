"""One builder per zoo kind: spec fields -> (model, loss_fn, example batch).

Builders are called by :func:`meshplan.zoo.spec.build_zoo_workload` with the default device
already set and the global RNG already seeded; ``fields`` holds every field of the kind (defaults
filled in, validated by the spec), so a builder only maps spec names to config names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor, nn

from meshplan.zoo import gpt, mlp, moe, vgg, vit, vision, wresnet

Batch = tuple[tuple[Tensor, ...], Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
Fields = Mapping[str, int | float]
Parts = tuple[nn.Module, LossFn, Batch]


def _int(fields: Fields, name: str) -> int:
    value = fields[name]
    assert isinstance(value, int), (name, value)  # the spec validated every int field
    return value


def _build_mlp(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    hidden = _int(fields, "hidden")
    model = mlp.MLP(hidden, _int(fields, "layers"), bias=bool(fields["bias"]))
    batch = mlp.make_example_batch(_int(fields, "batch"), hidden, device=device, generator=generator)
    return model, mlp.mlp_loss, batch


def _build_gpt(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    """gpt and bert: the same module, only the sizes differ."""
    config = gpt.GPTConfig(
        hidden=_int(fields, "hidden"),
        num_layers=_int(fields, "layers"),
        num_heads=_int(fields, "heads"),
        seq_len=_int(fields, "seq"),
        vocab_size=_int(fields, "vocab"),
        flash=bool(fields.get("flash", 1)),
    )
    batch = gpt.make_example_batch(config, _int(fields, "batch"), device=device, generator=generator)
    return gpt.GPT(config), gpt.gpt_loss, batch


def _build_moe(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    config = moe.MoEConfig(
        hidden=_int(fields, "hidden"),
        num_layers=_int(fields, "layers"),
        num_heads=_int(fields, "heads"),
        num_experts=_int(fields, "experts"),
        seq_len=_int(fields, "seq"),
        vocab_size=_int(fields, "vocab"),
        capacity=float(fields["capacity"]),
        expert_ffn=_int(fields, "expert_ffn"),
    )
    batch = gpt.make_example_batch(config.dense, _int(fields, "batch"), device=device, generator=generator)
    return moe.MoETransformer(config), gpt.gpt_loss, batch


def _image_batch(fields: Fields, image: int, num_classes: int, device: str, generator: torch.Generator) -> Batch:
    return vision.make_image_batch(_int(fields, "batch"), image, num_classes, device=device, generator=generator)


def _build_wresnet(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    config = wresnet.WResNetConfig(
        num_layers=_int(fields, "layers"),
        channels=_int(fields, "channels"),
        width=_int(fields, "width"),
        image=_int(fields, "image"),
        num_classes=_int(fields, "classes"),
    )
    batch = _image_batch(fields, config.image, config.num_classes, device, generator)
    return wresnet.WideResNet(config), vision.classification_loss, batch


def _build_vgg19(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    config = vgg.VGGConfig(
        channels=_int(fields, "channels"),
        fc=_int(fields, "fc"),
        image=_int(fields, "image"),
        num_classes=_int(fields, "classes"),
    )
    batch = _image_batch(fields, config.image, config.num_classes, device, generator)
    return vgg.VGG19(config), vision.classification_loss, batch


def _build_vit(fields: Fields, device: str, generator: torch.Generator) -> Parts:
    config = vit.ViTConfig(
        hidden=_int(fields, "hidden"),
        num_layers=_int(fields, "layers"),
        num_heads=_int(fields, "heads"),
        patch=_int(fields, "patch"),
        image=_int(fields, "image"),
        num_classes=_int(fields, "classes"),
    )
    batch = _image_batch(fields, config.image, config.num_classes, device, generator)
    return vit.ViT(config), vision.classification_loss, batch


BUILDERS: Mapping[str, Callable[[Fields, str, torch.Generator], Parts]] = MappingProxyType({
    "mlp": _build_mlp,
    "gpt": _build_gpt,
    "bert": _build_gpt,
    "moe": _build_moe,
    "wresnet": _build_wresnet,
    "vgg19": _build_vgg19,
    "vit": _build_vit,
})
