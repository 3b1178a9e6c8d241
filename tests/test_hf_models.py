"""Hugging Face models called the usual way train on 4 ranks exactly as on one device.

``model(input_ids=ids, attention_mask=mask, labels=labels)`` with padded positions and -100
labels, the model's own loss (``loss_fn=None``), default settings (KV cache on, sdpa attention,
dropout on): traced, planned with ``auto``/``data``/``megatron``/``zero3`` on (1,4) and (2,2),
trained 3 steps on emulated ranks and once over gloo against single-device training.
Tiny configs, random init, no downloads. Captures and plans are shared across cases.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch

import meshplan.api as api
from meshplan.capture.to_ir import capture
from meshplan.plan.plan import Plan
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.optim import OptimizerSpec, make_optimizer
from meshplan.zoo.spec import Workload
from oracle import ADAMW, SGD, assert_matches, train_rank

import transformers  # noqa: E402 -- pinned in the test extra: a missing install fails, never skips

VOCAB, BATCH, SEQ = 256, 4, 8
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _configs() -> dict[str, Callable[[], torch.nn.Module]]:
    t = transformers
    return {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=32)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**DECODER)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**DECODER)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32)),
        # Dropless mixtures of experts (traced through `capture/routed_experts.py`): Mixtral
        # renormalizes its top 2 of 4 experts, its loss with the router's load-balancing
        # term; Qwen2-MoE here keeps its top-2 weights as the softmax gave them and adds its
        # gated shared expert.
        "mixtral": lambda: t.MixtralForCausalLM(t.MixtralConfig(
            **DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.1)),
        "qwen2_moe": lambda: t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            **DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
            shared_expert_intermediate_size=64, norm_topk_prob=False)),
        # DeepSeek-V3: multi-head latent attention, a dense first layer, then a grouped
        # sigmoid router (its top group of two) over 4 experts and a shared expert.
        "deepseek_v3": lambda: t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            **{**DECODER, "num_key_value_heads": 4}, moe_intermediate_size=32,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16)),
        # DeepSeek-V2: its rotary embedding in complex numbers (no kv heads of its own).
        "deepseek_v2": lambda: t.DeepseekV2ForCausalLM(t.DeepseekV2Config(
            **{**DECODER, "num_key_value_heads": 4}, moe_intermediate_size=32,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, topk_method="group_limited_greedy", n_shared_experts=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)),
    }


MODELS = ("gpt2", "bert", "llama", "qwen2", "gpt_neox", "mixtral", "qwen2_moe", "deepseek_v3")


def build(name: str) -> torch.nn.Module:
    """The seeded model in training mode. Parameters HF initializes to zero (biases) get small
    random values, so the relative parameter check has a scale for each of them."""
    torch.manual_seed(0)
    model = _configs()[name]()
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.02)
    return model.train()


def batch(name: str, seed: int) -> dict[str, torch.Tensor]:
    """Keyword arguments as a user writes them: right padding in two rows, -100 labels on the
    padding (and, for the masked LM, on every position not masked out)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    mask[3, -1:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    if name == "bert":
        labels[torch.rand(BATCH, SEQ, generator=g) > 0.3] = -100
        labels[0, 0] = ids[0, 0]  # at least one target
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def data(name: str) -> list[dict[str, torch.Tensor]]:
    return [batch(name, seed) for seed in (1, 2, 3)]


def reference(name: str, opt: OptimizerSpec) -> tuple[list[float], dict]:
    """Single-device training; step i's dropout draws after torch.manual_seed(i), as the
    Trainer's default seed."""
    model = copy.deepcopy(build(name))
    o = make_optimizer(opt, model.parameters())
    losses = []
    for i, b in enumerate(data(name)):
        torch.manual_seed(i)
        loss = model(**b).loss
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


_MODELS: dict[str, Workload] = {}
_CAPTURES: dict[str, Any] = {}
_PLANS: dict[tuple, Plan] = {}
_REFS: dict[tuple, tuple] = {}


def workload(name: str) -> Workload:
    if name not in _MODELS:
        _MODELS[name] = Workload(model=build(name), loss_fn=None, example_batch=batch(name, 0),
                                 name=name)
    return _MODELS[name]


def make_plan(name: str, method: str, shape: tuple[int, int], opt: OptimizerSpec) -> Plan:
    key = (name, method, shape, opt.kind)
    if key not in _PLANS:
        w = workload(name)
        # auto under unit α-β costs (Alpa's setting) splits the matmuls: tensor parallelism
        # and resharding, not just the cheapest replication.
        abstract = {"alpha": (1.0, 1.0), "beta": (1.0, 1.0)} if method == "auto" else {}
        _PLANS[key] = api.plan(w.model, None, opt, w.example_batch, "local:4", mesh_shape=shape,
                               method=method, memory_budget_gb=0, name=name, **abstract)
    return _PLANS[key]


def ref(name: str, opt: OptimizerSpec) -> tuple:
    if (name, opt.kind) not in _REFS:
        _REFS[(name, opt.kind)] = reference(name, opt)
    return _REFS[(name, opt.kind)]


def check_emulated(name: str, method: str, shape: tuple[int, int], opt: OptimizerSpec) -> None:
    w = workload(name)
    if name not in _CAPTURES:
        _CAPTURES[name] = capture(w.model, None, w.example_batch)
    plan = make_plan(name, method, shape, opt)
    for result in run_emulated(train_rank, shape, plan, w, data(name), _CAPTURES[name]):
        assert_matches(result, ref(name, opt), plan, opt)


CASES = [(m, s) for m in ("data", "megatron", "zero3", "auto") for s in ((1, 4), (2, 2))]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method,shape", CASES, ids=[f"{m}-{s[0]}x{s[1]}" for m, s in CASES])
def test_hf_model_trains_like_one_device_sgd(name: str, method: str, shape) -> None:
    check_emulated(name, method, shape, SGD)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method", ["data", "megatron", "zero3", "auto"])
def test_hf_model_trains_like_one_device_adamw(name: str, method: str) -> None:
    check_emulated(name, method, (2, 2), ADAMW)


def test_hf_loss_count_is_a_planned_collective() -> None:
    # -100 labels: the mean's divisor is the global count of real targets, one scalar
    # all-reduced over the batch axes, which the plan lists (and the runtime records exactly).
    plan = make_plan("llama", "data", (1, 4), SGD)
    scalar = [c for c in plan.collectives if c.kind == "all_reduce" and c.bytes == 4
              and c.phase == "forward"]
    assert scalar and tuple(scalar[0].mesh_axes) == (1,), plan.collectives


def test_complex_rotary_embeddings_split_with_their_heads() -> None:
    # DeepSeek-V2 rotates queries and keys as complex numbers (view_as_complex, polar,
    # view_as_real): signed ops that split over batch and heads, no replicated fallback.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        check_emulated("deepseek_v2", "megatron", (1, 4), SGD)
        check_emulated("deepseek_v2", "data", (2, 2), SGD)
    ops = [o for o in make_plan("deepseek_v2", "megatron", (1, 4), SGD).ops
           if o.op in ("view_as_complex", "view_as_real")]
    # Per layer, the queries' two views split over heads with Megatron's attention; the key's
    # rotary part is one head that all share (MLA), whole.
    assert len(ops) == 2 * 2 * 2, ops
    assert [o.inputs[0].split(",")[1] for o in ops if "S" in o.strategy] == ["S1"] * 4, ops


# ---------------------------------------------------------------- once over real gloo
def _train_gloo(rank: int, nprocs: int, plan: Plan, name: str) -> tuple:
    from meshplan.runtime.comm import ProcessGroupComm
    comm = ProcessGroupComm(plan.mesh_shape)
    w = Workload(model=build(name), loss_fn=None, example_batch=batch(name, 0), name=name)
    return train_rank(comm, plan, w, data(name))


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_hf_decoder_over_gloo(pool4, name: str) -> None:
    # Mixtral's experts split over their hidden units on one axis, tokens on the other.
    plan = make_plan(name, "megatron", (2, 2), SGD)
    for result in pool4.run(_train_gloo, plan, name):
        assert_matches(result, ref(name, SGD), plan, SGD)


def _pipeline_rank(comm, p2p, plan: Plan, name: str) -> tuple:
    from meshplan.runtime.pipeline import PipelineTrainer
    tr = PipelineTrainer(plan, workload(name).model, None, batch(name, 0), comm, p2p)
    return [tr.step(b, seed=i) for i, b in enumerate(data(name))], tr.full_state_dict()


def test_a_mixture_of_experts_pipeline_trains_like_one_device() -> None:
    # Two stages, the experts split over 2 devices, two micro-batches: the stage programs
    # call the experts' op on each micro-batch's tokens.
    from meshplan.runtime.emulated import run_emulated_stages
    w = workload("qwen2_moe")
    plan = api.plan(w.model, None, SGD, w.example_batch, "local:4",
                    method="megatron:dp=1,tp=2,pp=2", memory_budget_gb=0, microbatches=2,
                    dtype="fp32")
    assert len(plan.stages) == 2 and [o.strategy for s in plan.stages for o in s.plan.ops
                                      if o.op == "routed_experts"] == ["f:S1", "f:S1"]
    results = run_emulated_stages(_pipeline_rank, plan.stage_meshes(), plan, "qwen2_moe")
    params: dict = {}
    for _, state in results:
        params.update(state)
    assert_matches((results[0][0], params, []), ref("qwen2_moe", SGD), plan, SGD)


def test_mixtrals_load_balancing_loss_is_named_where_micro_batches_cannot_add_it_up() -> None:
    # Its router's loss multiplies two means over every token of the batch: two micro-batches'
    # losses averaged are not the batch's, and planning says so rather than train otherwise
    # unannounced.
    w = workload("mixtral")
    with pytest.warns(UserWarning, match="2 micro-batches cannot make this loss's full-batch "
                                         "step exactly"):
        api.plan(w.model, None, SGD, w.example_batch, "local:4",
                 method="megatron:dp=1,tp=2,pp=2", memory_budget_gb=0, microbatches=2,
                 dtype="fp32")


@pytest.mark.parametrize("name", [m for m in MODELS if m != "bert"])
def test_hf_decoders_run_with_default_settings(name: str) -> None:
    # What the tests above plan is HF's default path: sdpa attention and the KV cache on.
    config = workload(name).model.config
    assert config._attn_implementation == "sdpa" and config.use_cache
