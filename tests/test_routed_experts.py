"""Dropless mixtures of experts as one op of static shape (`capture/routed_experts.py`) and
transformers' sparse-MoE blocks traced through it (`capture/moe_blocks.py`).

The parallel plans of Mixtral and Qwen2-MoE are checked against one device in
`test_hf_models.py`; here: the op's gradient, the blocks' forward equal to transformers' loop,
the op under autocast, its signature, and what is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from meshplan.capture.moe_blocks import static_routing
from meshplan.capture.routed_experts import routed_experts, routed_experts_rule
from meshplan.capture.rule_base import OpCall
from meshplan.capture.to_ir import capture
from meshplan.cost.compute import backward_factor, forward_backward_times
from meshplan.cost.devices import device_type

T, H, F, E, K = 7, 5, 6, 4, 2
TOY = device_type("V100-SXM2-16GB")


def _operands(dtype: torch.dtype = torch.float64) -> tuple:
    g = torch.Generator().manual_seed(0)
    # Expert 3 gets no token: its weights' gradients are zero, not missing.
    experts = torch.stack([torch.randperm(3, generator=g)[:K] for _ in range(T)])
    mats = [torch.randn(F, H, generator=g, dtype=dtype) for _ in range(2 * E)] + \
        [torch.randn(H, F, generator=g, dtype=dtype) for _ in range(E)]
    x = torch.randn(T, H, generator=g, dtype=dtype)
    weights = torch.rand(T, K, generator=g, dtype=dtype)
    return x, experts, weights, mats


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_the_ops_gradient_is_its_forwards(act: str) -> None:
    x, experts, weights, mats = _operands()

    def op(x, weights, *mats):
        return routed_experts(x, experts, weights, list(mats[:E]), list(mats[E:2 * E]),
                              list(mats[2 * E:]), act)

    inputs = tuple(t.requires_grad_() for t in (x, weights, *mats))
    assert torch.autograd.gradcheck(op, inputs)
    op(*inputs).sum().backward()
    assert not mats[3].grad.any() and mats[0].grad.any()


def _moe(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2)).train()
    if name == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, num_experts=4, num_experts_per_tok=2)).train()
    if name == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
            norm_topk_prob=True)).train()
    # DeepSeek's layout: a grouped router module and the loop in a method of its own
    # (`moe_blocks.EXPERT_LOOPS`), here with multi-head latent attention (V2, V3) and a shared
    # expert; every layer sparse.
    deepseek = dict(common, moe_intermediate_size=40, first_k_dense_replace=0,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8)
    if name == "deepseek_v3":
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**deepseek, **mla})).train()
    if name == "deepseek_v2":
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            **{**deepseek, **mla}, topk_method="group_limited_greedy", n_shared_experts=1)).train()
    if name == "glm4_moe":
        return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**deepseek)).train()
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=24, norm_topk_prob=name.endswith("normed"))).train()


def _patched(model: torch.nn.Module) -> int:
    return sum(a in vars(m) for m in model.modules() for a in ("forward", "moe"))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen2_moe-normed", "qwen3_moe",
                                  "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_the_blocks_compute_what_transformers_loop_computes(name: str) -> None:
    model = _moe(name)
    with torch.no_grad():   # DeepSeek-V3's router bias starts at zero: give it a say
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    ours = copy.deepcopy(model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with static_routing(ours):
        assert _patched(ours) == 2   # each layer's block
        static = ours(input_ids=ids, labels=ids).loss
        static.backward()
    # The same operations in the same order (V2 sums a token's experts slot by slot, the op
    # expert by expert: equal here, to rounding in general).
    assert static.item() == loss.item()
    for (k, a), b in zip(model.named_parameters(), ours.parameters()):
        if a.grad is None:   # an expert no token chose: transformers' loop never calls it
            assert b.grad is None or not b.grad.any(), k
            continue
        assert (a.grad - b.grad).norm() <= 1e-5 * a.grad.norm(), k
    # The model keeps its own code: nothing is left patched.
    assert _patched(ours) == 0


def test_a_traced_block_is_one_op_over_every_experts_weights() -> None:
    model = _moe("mixtral")
    ids = torch.randint(0, 128, (2, 8))
    _, graph = capture(model, None, {"input_ids": ids, "labels": ids})
    ops = [n for n in graph.nodes if n.op == "routed_experts"]
    assert len(ops) == 2 and not graph.unsupported_ops
    assert sum(graph.by_name[i].role == "param" for i in ops[0].inputs) == 3 * 4
    assert not any("forward" in vars(m) for m in model.modules())


def test_under_autocast_the_op_computes_at_the_half_type() -> None:
    x, experts, weights, mats = _operands(torch.float32)
    exact = routed_experts(x, experts, weights, mats[:E], mats[E:2 * E], mats[2 * E:], "silu")
    leaves = [t.clone().requires_grad_() for t in (x, weights, *mats)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = routed_experts(leaves[0], experts, leaves[1], leaves[2:2 + E],
                             leaves[2 + E:2 + 2 * E], leaves[2 + 2 * E:], "silu")
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), exact, rtol=0.05, atol=0.05 * exact.abs().max())
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 and t.grad.isfinite().all() for t in leaves)


def test_the_signature_splits_tokens_and_hidden_units_only() -> None:
    shapes = ((T, H), (T, K), (T, K)) + ((F, H),) * (2 * E) + ((H, F),) * E
    rule = routed_experts_rule(OpCall("routed_experts", shapes, (T, H), (), ()))
    assert set(rule.sig.splittable_atoms()) == {"t", "f"}
    assert rule.sig.reduced_atoms == {"f", "k"}
    # Three products forward; backward recomputes two and does six more, priced so.
    assert rule.flops == 3 * 2.0 * T * K * H * F
    fwd, bwd = forward_backward_times(rule.flops, 0.0, TOY, "float32",
                                      backward_factor("routed_experts", rule.sig.kind))
    assert bwd == pytest.approx(8 / 3 * fwd)


def test_router_noise_and_biased_experts_are_refused_with_the_reason() -> None:
    model = _moe("mixtral")
    ids = torch.randint(0, 128, (2, 8))
    noisy = copy.deepcopy(model)
    noisy.model.layers[0].block_sparse_moe.jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise=0"):
        capture(noisy, None, {"input_ids": ids, "labels": ids})
    biased = copy.deepcopy(model)
    expert = biased.model.layers[1].block_sparse_moe.experts[2]
    expert.w3 = torch.nn.Linear(32, 48)
    with pytest.raises(ValueError, match=r"layers\.1\.block_sparse_moe.*bias-free.*w3"):
        capture(biased, None, {"input_ids": ids, "labels": ids})
    fused = copy.deepcopy(model)   # a later transformers' layout: experts in one module
    fused.model.layers[0].block_sparse_moe.experts = torch.nn.Identity()
    with pytest.raises(ValueError, match="ModuleList of gated MLPs.*Identity"):
        capture(fused, None, {"input_ids": ids, "labels": ids})
    assert not any("forward" in vars(m)
                   for m in (*noisy.modules(), *biased.modules(), *fused.modules()))


def test_identity_experts_are_refused_with_the_reason() -> None:
    """LongCat-Flash's "zero-computation" experts are ``nn.Identity``: not a gated MLP."""
    model = _moe("deepseek_v3")
    model.model.layers[1].mlp.experts[5] = torch.nn.Identity()
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp \(DeepseekV3MoE\).*gated MLPs.*"
                                         r"holding 1 Identity"):
        capture(model, None, {"input_ids": ids, "labels": ids})
    assert _patched(model) == 0
