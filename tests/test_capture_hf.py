"""Hugging Face models called the usual way capture with every op signed: GPT-2's and Llama's
key/value cache (a 1-D empty tensor concatenated with the keys), BERT's all-ones mask shortcut
(a value-dependent branch), Llama's rotary embedding (cos/sin) and masked attention."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from meshplan.capture.to_ir import capture

import transformers  # noqa: E402 -- pinned in the test extra: a missing install fails, never skips

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


@pytest.mark.parametrize("method", ["data", "auto"])
def test_falcon_tensor_constants_are_materialized_and_train_like_one_device(method: str) -> None:
    # Falcon's forward makes tensors from Python values: fx keeps them as get_attr constants,
    # which each rank's local program must hold (they were once taken for ops).
    import meshplan.api as api
    from meshplan.runtime.emulated import run_emulated
    from meshplan.zoo.spec import Workload
    from oracle import SGD, assert_matches, reference, train_rank

    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    data = [((torch.randint(0, VOCAB, (4, 8), generator=g),),
             torch.randint(0, VOCAB, (4, 8), generator=g)) for _ in range(2)]
    traced, _ = capture(model, lm_loss, data[0])
    assert any(n.op == "get_attr" for n in traced.graph_module.graph.nodes)
    w = Workload(model, lm_loss, data[0], "falcon")
    extra = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
    plan = api.plan(model, lm_loss, SGD, data[0], "local:4", mesh_shape=(2, 2), method=method,
                    memory_budget_gb=0, **extra)
    ref = reference(w, SGD, data)
    for r in run_emulated(train_rank, (2, 2), plan, w, data):
        assert_matches(r, ref, plan, SGD)
