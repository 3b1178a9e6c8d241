"""Hugging Face models by name (issue 26.4): ``hf:NAME`` from meshplan's table of well-known
configurations (each model's parameter count is the published one), ``hf:path/config.json``,
fields overridden as zoo specs' are, built on the meta device and planned like any model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import meshplan.api as api
from meshplan.sim.simulate import simulate
from meshplan.zoo.hf_catalog import CATALOG, parse_hf_spec
from meshplan.zoo.spec import build_workload


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_each_named_model_has_its_published_size(name: str) -> None:
    w = build_workload(f"hf:{name}")   # on the meta device: a 405B model in a second
    params = sum(p.numel() for p in w.model.parameters()) / 1e6
    assert params == pytest.approx(CATALOG[name][2], rel=0.005), (name, params)
    assert w.loss_fn is None and set(w.example_batch) == {"input_ids", "labels"}
    assert next(w.model.parameters()).device.type == "meta"


def test_fields_override_the_configuration_and_the_batch() -> None:
    w = build_workload("hf:llama-3-8b,layers=2,hidden=256,heads=8,kv=2,ffn=512,vocab=1000,"
                       "batch=4,seq=32")
    c = w.model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (2, 256, 8, 2, 512, 1000)
    assert c.rope_theta == 500000.0   # the rest is Llama 3's
    assert tuple(w.example_batch["input_ids"].shape) == (4, 32)
    small = build_workload("hf:gpt2,layers=1,hidden=32,heads=2,vocab=100,batch=2,seq=8",
                           device="cpu")   # small enough to train: real token ids
    assert int(small.example_batch["input_ids"].max()) < 100


def test_a_config_json_names_its_architecture(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 128, "sliding_window": 8}))
    w = build_workload(f"hf:{path},batch=4,seq=16")
    assert type(w.model).__name__ == "MistralForCausalLM"
    plan = api.plan(w.model, None, "adamw", w.example_batch, "local:2", mesh_shape=(1, 2),
                    method="megatron", dtype="fp32", name=str(path))
    assert simulate(plan).step_time_s > 0


@pytest.mark.parametrize("name", ["t5-base", "bert-base", "qwen2.5-7b", "gemma-2-9b",
                                  "phi-3-mini"])
def test_each_architecture_plans(name: str) -> None:
    # Shrunk by overrides, each family's own forward and loss trace and plan.
    w = build_workload(f"hf:{name},layers=1,vocab=256,batch=4,seq=16")
    plan = api.plan(w.model, None, "adamw", w.example_batch, "local:2", mesh_shape=(1, 2),
                    method="data", dtype="fp32", name=name)
    assert simulate(plan).step_time_s > 0


def test_mixtral_plans_by_name_with_its_experts_split() -> None:
    # transformers' Mixtral finds each expert's tokens by value (nonzero); traced as one op of
    # static shape (`capture/routed_experts.py`), its experts split over their hidden units.
    w = build_workload("hf:mixtral-8x7b,layers=1,vocab=256,batch=4,seq=16")
    plan = api.plan(w.model, None, "adamw", w.example_batch, "local:2", mesh_shape=(1, 2),
                    method="megatron", dtype="fp32")
    assert [o.strategy for o in plan.ops if o.op == "routed_experts"] == ["f:S1"]
    assert simulate(plan).step_time_s > 0


@pytest.mark.parametrize("spec,message", [
    ("hf:llama-9", "unknown model; known: bert-base"),
    ("hf:gpt2,layers", "is not field=value"),
    ("hf:gpt2,batch=0", "batch=0 must be an int >= 1"),
    ("hf:/nowhere/config.json", "no such config file"),
])
def test_bad_specs_say_what_is_valid(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hf_spec(spec)


def test_a_field_its_configuration_lacks_is_named() -> None:
    with pytest.raises(ValueError, match="no field 'experts'"):
        build_workload("hf:llama-3-8b,experts=8")


def test_the_command_line_plans_a_model_by_name() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "meshplan", "plan",
         "hf:qwen2.5-7b,layers=2,hidden=128,heads=4,kv=2,ffn=256,vocab=512,batch=4,seq=32",
         "--cluster", "local:2", "--mesh", "1x2", "--json", "--simulate"],
        capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert doc["model"].startswith("hf:qwen2.5-7b") and doc["simulated"]["step_time_s"] > 0
