"""Tiny Hugging Face models as their authors wrote them (random init from a config, no
downloads), and batches as people feed them: keyword arguments with padding and -100 labels."""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers as T

from meshplan.zoo.spec import Workload

VOCAB, BATCH, SEQ = 256, 4, 16
_DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                vocab_size=VOCAB, max_position_embeddings=32)

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                   vocab_size=VOCAB, n_positions=32)),
    "bert-mlm": lambda: T.BertForMaskedLM(T.BertConfig(**_DECODER)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DECODER, num_key_value_heads=2)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_DECODER, num_key_value_heads=2)),
    "gpt-neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_DECODER)),
}


def hf_batches(name: str, n: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of keyword arguments: right padding on some rows (attention_mask 0, label
    -100); a masked LM predicts only about a sixth of its tokens, the others labelled -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        if name == "bert-mlm":
            labels = labels.masked_fill(torch.rand(BATCH, SEQ, generator=g) > 0.17, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def hf_workload(name: str) -> Workload:
    """The model with its own loss (``labels=``): no loss_fn."""
    torch.manual_seed(0)
    model = MODELS[name]()
    return Workload(model, None, hf_batches(name, 1, seed=99)[0], name)


