"""Model FLOPs per step against the textbook count for a dense GPT and by hand for top-k MoE."""

from __future__ import annotations

import pytest

from megamoe.train.convert import build_config
from megamoe.train.metrics import flops_per_iteration

L, H, S, V, HEADS, GBS = 2, 64, 128, 256, 4, 8


def _cfg(**params: object):
    base = {"num_layers": L, "hidden_size": H, "num_attention_heads": HEADS, "seq_length": S, "vocab_size": V}
    return build_config({}, {**base, **params})


def test_flops_dense_gelu_gpt_is_24lh2_plus_causal_attention_plus_logits_times_three() -> None:
    cfg = _cfg(swiglu=False)
    per_token = L * (24 * H * H + 2 * S * H) + 2 * H * V  # 4h^2 attention + 8h^2 MLP weights; QK^T+AV halved
    assert flops_per_iteration(cfg, GBS, V) == pytest.approx(3 * per_token * GBS * S)


def test_flops_moe_counts_topk_routed_shared_and_router_only_in_moe_layers() -> None:
    cfg = _cfg(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=16,
               moe_layer_freq="[0,1]", ffn_hidden_size=128)  # fmt: skip
    attention = L * (2 * 4 * H * H + 2 * S * H)
    dense_mlp = 2 * 3 * H * 128  # layer 0, SwiGLU
    moe_mlp = 2 * (2 * 3 * H * 32 + H * 8 + 3 * H * 16)  # layer 1: top-2 experts, router, shared expert
    per_token = attention + dense_mlp + moe_mlp + 2 * H * V
    assert flops_per_iteration(cfg, GBS, V) == pytest.approx(3 * per_token * GBS * S)


def test_flops_full_recompute_adds_one_forward() -> None:
    plain, recompute = _cfg(), _cfg(recompute_granularity="full")
    assert flops_per_iteration(recompute, GBS, V) == pytest.approx(flops_per_iteration(plain, GBS, V) * 4 / 3)
