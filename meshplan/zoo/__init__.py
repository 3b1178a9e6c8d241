"""Model zoo: reference models (MLP, GPT) and the MODEL spec that names a workload to plan."""

from meshplan.zoo.spec import ModelSpec, Workload, build_workload, build_zoo_workload, parse_model_spec

__all__ = ["ModelSpec", "Workload", "build_workload", "build_zoo_workload", "parse_model_spec"]
