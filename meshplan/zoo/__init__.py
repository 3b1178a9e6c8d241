"""Model zoo: the papers' reference models and the MODEL spec that names a workload to plan.

Kinds: mlp, gpt (Alpa's and Megatron's presets), bert, moe (GShard, Alpa's presets), wresnet
(Alpa's presets), vgg19 and vit (HAP's configurations); see :mod:`meshplan.zoo.catalog`.
"""

from meshplan.zoo.spec import (
    ModelSpec,
    Workload,
    build_workload,
    build_zoo_workload,
    describe_zoo,
    parse_model_spec,
)

__all__ = ["ModelSpec", "Workload", "build_workload", "build_zoo_workload", "describe_zoo", "parse_model_spec"]
