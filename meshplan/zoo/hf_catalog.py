"""Hugging Face models by name: ``hf:NAME[,field=value...]`` or ``hf:path/config.json[,...]``.

Planning a published model should not need a Python file that builds it: transformers already
has its architecture, and its configuration is a handful of numbers. `CATALOG` holds those of
well-known models, written from transformers' config classes and the sizes their authors
published (no download; `tests/test_hf_catalog.py` checks each model's parameter count against
the published one). A ``config.json`` (as a model's hub repository holds it) works too: its
``model_type`` names the transformers class.

Fields after the name override the configuration (any attribute of the config class, or the
short names ``layers``, ``hidden``, ``heads``, ``kv``, ``ffn``, ``vocab``) or set the example
batch (``batch``: sequences per step, ``seq``: tokens per sequence). The model is built on the
meta device (sizes only: a 405B model in seconds), or materialized on another device for a
model small enough to train. Its loss is its own (``labels=``): causal LMs predict the next
token, BERT its masked tokens, T5 its targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# name: (model_type, configuration fields, parameters published (millions))
CATALOG: dict[str, tuple[str, dict[str, Any], float]] = {
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8,
                                 vocab_size=128256, max_position_embeddings=8192,
                                 rope_theta=500000.0), 8030),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672,
                                  num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0), 70554),
    "llama-3.1-405b": ("llama", dict(hidden_size=16384, intermediate_size=53248,
                                     num_hidden_layers=126, num_attention_heads=128,
                                     num_key_value_heads=8, vocab_size=128256,
                                     max_position_embeddings=131072, rope_theta=500000.0),
                       405853),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0,
                                   tie_word_embeddings=True), 1236),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32,
                                 vocab_size=32000, max_position_embeddings=4096), 6738),
    "llama-2-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824,
                                  num_hidden_layers=40, num_attention_heads=40,
                                  num_key_value_heads=40, vocab_size=32000,
                                  max_position_embeddings=4096), 13016),
    "llama-2-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672,
                                  num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, vocab_size=32000,
                                  max_position_embeddings=4096), 68977),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=32768, sliding_window=4096),
                   7242),
    "phi-3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32,
                                vocab_size=32064, max_position_embeddings=4096,
                                original_max_position_embeddings=4096, pad_token_id=32000),
                   3821),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2,
                                     max_position_embeddings=32768, rope_theta=1e6), 46703),
    "mixtral-8x22b": ("mixtral", dict(hidden_size=6144, intermediate_size=16384,
                                      num_hidden_layers=56, num_attention_heads=48,
                                      num_key_value_heads=8, vocab_size=32768,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      max_position_embeddings=65536, rope_theta=1e6), 140621),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864,
                                   num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1e6,
                                   tie_word_embeddings=True), 494),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1e6,
                                   tie_word_embeddings=True), 1544),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008,
                                 num_hidden_layers=36, num_attention_heads=16,
                                 num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1e6,
                                 tie_word_embeddings=True), 3086),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4,
                                 vocab_size=152064, max_position_embeddings=32768,
                                 rope_theta=1e6), 7616),
    "qwen2.5-14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824,
                                  num_hidden_layers=48, num_attention_heads=40,
                                  num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=32768, rope_theta=1e6), 14770),
    "qwen2.5-32b": ("qwen2", dict(hidden_size=5120, intermediate_size=27648,
                                  num_hidden_layers=64, num_attention_heads=40,
                                  num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=32768, rope_theta=1e6), 32764),
    "qwen2.5-72b": ("qwen2", dict(hidden_size=8192, intermediate_size=29568,
                                  num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=32768, rope_theta=1e6), 72706),
    # DeepSeek's mixtures of experts: multi-head latent attention, a dense first layer, then
    # routed experts and shared ones (`capture/moe_blocks.EXPERT_LOOPS`). DeepSeek-V3 (256
    # experts on each of 58 layers) is not here: transformers takes 22 s to build its 44,544
    # expert modules even on the meta device, and its planning is not yet measured.
    "deepseek-v2-lite": ("deepseek_v2", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=102400, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False), 15706),
    "gemma-2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                  vocab_size=256000), 2614),
    "gemma-2-9b": ("gemma2", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                  vocab_size=256000), 9242),
    "gemma-2-27b": ("gemma2", dict(hidden_size=4608, intermediate_size=36864,
                                   num_hidden_layers=46, num_attention_heads=32,
                                   num_key_value_heads=16, head_dim=128, vocab_size=256000),
                    27227),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                          n_positions=1024), 124),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257,
                             n_positions=1024), 1558),
    "bert-base": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, vocab_size=30522), 110),
    "bert-large": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, vocab_size=30522), 335),
    # T5 starts its decoder from the padding token, as its published configs say.
    "t5-base": ("t5", dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64,
                           vocab_size=32128, decoder_start_token_id=0, pad_token_id=0,
                           eos_token_id=1), 223),
    "t5-large": ("t5", dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64,
                            vocab_size=32128, decoder_start_token_id=0, pad_token_id=0,
                            eos_token_id=1), 738),
}

ALIASES = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
           "kv": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size"}
BATCH_FIELDS = {"batch": 8, "seq": 1024}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("hf: models need Hugging Face transformers: pip install "
                          "'meshplan[hf]' (or transformers>=4.50)") from None
    return transformers


def parse_hf_spec(text: str) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """``(model_type, config fields, {batch, seq}, name)`` of an ``hf:`` spec. Raises ValueError
    naming the known models, or the bad field."""
    body = text.strip().removeprefix("hf:")
    name, *items = [part.strip() for part in body.split(",")]
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"hf:{name}: no such config file")
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ValueError(f"hf:{name}: the config has no model_type (as a hub config.json "
                             "has: llama, mistral, qwen2, gemma2, gpt2, bert, t5, ...)")
    elif name in CATALOG:
        model_type, fields, _ = CATALOG[name]
        fields = dict(fields)
    else:
        raise ValueError(f"hf:{name}: unknown model; known: {', '.join(sorted(CATALOG))}, or "
                         "hf:path/to/config.json")
    sizes = dict(BATCH_FIELDS)
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"{text!r}: '{item}' is not field=value")
        parsed = _value(value.strip())
        if key in sizes:
            if isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < 1:
                raise ValueError(f"{text!r}: {key}={value} must be an int >= 1")
            sizes[key] = parsed
        else:
            fields[ALIASES.get(key, key)] = parsed
    return model_type, fields, sizes, text.strip()


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def build_hf_model(model_type: str, fields: dict[str, Any], device: str = "meta") -> Any:
    """The transformers model of ``model_type`` with ``fields``, built on ``device``, in
    training mode. Raises ValueError for a field its config class does not have."""
    import torch
    t = _transformers()
    default = t.AutoConfig.for_model(model_type)
    unknown = [key for key in fields if not hasattr(default, key)]
    if unknown:
        raise ValueError(f"{model_type} configurations have no field {unknown[0]!r}")
    # Given at construction: a config derives fields from others (Qwen2's layer types from
    # its layer count, tied embeddings).
    config = t.AutoConfig.for_model(model_type, **fields, use_cache=False)
    # A vocabulary shrunk by the fields (``vocab=256``) leaves the published padding token
    # past its end (Phi-3's 32000): the embedding would refuse it as its padding index.
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and pad >= vocab:
        config.pad_token_id = None
    kind = {"bert": t.AutoModelForMaskedLM, "t5": t.AutoModelForSeq2SeqLM}.get(
        model_type, t.AutoModelForCausalLM)
    with torch.device(device):
        model = kind.from_config(config)
    return model.train()


def hf_workload(text: str, *, device: str = "meta", seed: int = 0) -> Any:
    """The `Workload` of an ``hf:`` spec (module docstring): the model, its own loss, and an
    example batch of ``batch`` sequences of ``seq`` tokens with their labels."""
    import torch

    from meshplan.zoo.spec import Workload
    model_type, fields, sizes, name = parse_hf_spec(text)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_hf_model(model_type, fields, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sizes["batch"], sizes["seq"]), generator=g).to(device)
    return Workload(model=model, loss_fn=None,
                    example_batch={"input_ids": ids, "labels": ids.clone()}, name=name)
