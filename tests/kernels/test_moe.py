"""The routed-experts op against the per-token loop reference and transformers' router arithmetic."""

import pytest
import torch

from quire.kernels import moe

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 64, 96
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def expert_weights(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN**-0.5
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE**-0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def inputs(num_tokens, dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    router_logits = (torch.randn(num_tokens, NUM_EXPERTS, generator=generator) * 2).to(dtype)
    return hidden, router_logits


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_the_per_token_reference(dtype, num_tokens, renormalize):
    w_gate_up, w_down = expert_weights(dtype)
    hidden, router_logits = inputs(num_tokens, dtype)
    expected = moe.moe_reference(hidden, router_logits, w_gate_up, w_down, TOP_K, renormalize)
    got = moe.fused_moe(hidden, router_logits, w_gate_up, w_down, TOP_K, renormalize)
    assert got.dtype == dtype and got.shape == hidden.shape
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    if moe.can_prepack_experts(w_gate_up):  # bfloat16 on the CPU's fastest path (oneDNN or Quire's kernel)
        packed = moe.prepack_experts(w_gate_up, w_down)
        got_packed = moe.fused_moe(hidden, router_logits, None, None, TOP_K, renormalize, packed)
        torch.testing.assert_close(got_packed, expected, **TOLERANCES[dtype])


def test_a_batch_runs_several_experts_and_weights_follow_renormalisation():
    _, router_logits = inputs(64, torch.float32)
    weights, expert_ids = moe.select_experts(router_logits, TOP_K, renormalize=True)
    assert weights.dtype == torch.float32 and expert_ids.shape == (64, TOP_K)
    assert len(expert_ids.unique()) == NUM_EXPERTS
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    raw, raw_ids = moe.select_experts(router_logits, TOP_K, renormalize=False)
    assert torch.equal(raw_ids, expert_ids) and bool((raw.sum(-1) < 1).all())
    # renormalised top-k probabilities are the softmax over the top-k logits
    torch.testing.assert_close(weights, torch.softmax(router_logits.gather(1, expert_ids), dim=-1))


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers_qwen3_moe(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    hidden, _ = inputs(7, torch.float32)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        logits, expected_weights, expected_ids = router(hidden)
    weights, expert_ids = moe.select_experts(logits, TOP_K, renormalize)
    assert torch.equal(expert_ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)


def test_tokens_routed_nowhere_else_are_untouched_by_inactive_experts():
    """An expert no token picked never runs: corrupting its weights changes nothing."""
    w_gate_up, w_down = expert_weights(torch.float32)
    hidden, router_logits = inputs(7, torch.float32)
    router_logits[:, 5] = -100.0
    expected = moe.fused_moe(hidden, router_logits, w_gate_up, w_down, TOP_K, True)
    w_gate_up[5], w_down[5] = float("nan"), float("nan")
    torch.testing.assert_close(moe.fused_moe(hidden, router_logits, w_gate_up, w_down, TOP_K, True), expected)
