"""Hugging Face models called the usual way capture with every op signed: GPT-2's and Llama's
key/value cache (a 1-D empty tensor concatenated with the keys), BERT's all-ones mask shortcut
(a value-dependent branch), Llama's rotary embedding (cos/sin) and masked attention."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from meshplan.capture.to_ir import capture

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _models() -> dict:
    torch.manual_seed(0)
    return {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16)),
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=16)),
    }


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_model_captures_with_every_op_signed(name: str) -> None:
    model = _models()[name]
    ids = torch.randint(0, VOCAB, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _, graph = capture(model, lm_loss, ((ids,), ids))
    assert graph.unsupported_ops == ()
