"""RouterConfig validation and the forced-balancing helpers (parity with megatron is in megatron/)."""

from __future__ import annotations

import pytest
import torch

from megamoe.errors import InvalidConfigError
from megamoe.router import AuxLossScaler, RouterConfig, even_assignment, topk_routing

BAD_CONFIGS = {
    "topk > E": (dict(num_experts=4, topk=5), "moe_router_topk=5"),
    "softmax top-1 without pre-softmax": (dict(num_experts=4, topk=1), "moe_router_topk=1"),
    "unknown score": (dict(num_experts=4, topk=2, score_function="relu"), "moe_router_score_function='relu'"),
    "groups do not divide E": (
        dict(num_experts=6, topk=2, num_groups=4, group_topk=2),
        "moe_router_num_groups=4",
    ),
    "group_topk > groups": (
        dict(num_experts=8, topk=2, num_groups=2, group_topk=3),
        "moe_router_group_topk=3",
    ),
    "group_topk does not divide topk": (
        dict(num_experts=8, topk=3, num_groups=4, group_topk=2),
        "moe_router_group_topk=2",
    ),
    "unknown forcing": (dict(num_experts=4, topk=2, force_load_balancing="all"), "moe_router_force_load"),
}


@pytest.mark.parametrize("bad", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_router_config_rejects_bad_values_naming_the_setting(bad):
    fields, prefix = bad
    with pytest.raises(InvalidConfigError) as info:
        RouterConfig(**fields)
    assert str(info.value).startswith(prefix)


def test_even_assignment_is_round_robin_over_slots():
    cfg = RouterConfig(num_experts=3, topk=2)
    assert even_assignment(4, cfg, torch.device("cpu")).tolist() == [[0, 1], [2, 0], [1, 2], [0, 1]]


def test_sigmoid_weights_are_normalised_then_scaled():
    cfg = RouterConfig(num_experts=4, topk=2, score_function="sigmoid", topk_scaling_factor=2.5)
    idx, weights = topk_routing(torch.tensor([[3.0, -1.0, 2.0, 0.0]]), cfg)
    assert idx.tolist() == [[0, 2]]
    torch.testing.assert_close(weights.sum(), torch.tensor(2.5))


def test_group_limited_topk_only_picks_from_the_best_groups():
    cfg = RouterConfig(num_experts=8, topk=2, num_groups=4, group_topk=1, pre_softmax=True)
    logits = torch.tensor([[5.0, 0.0, 4.9, 4.8, 0.0, 0.0, 0.0, 0.0]])  # best pair sum: group 1 (4.9+4.8)
    idx, _ = topk_routing(logits, cfg)
    assert sorted(idx.tolist()[0]) == [2, 3]


def test_aux_loss_scaler_uses_the_loss_scale_set_by_the_loop():
    weights = torch.ones(2, 2, requires_grad=True)
    aux = torch.tensor(0.5, requires_grad=True)
    AuxLossScaler.set_loss_scale(0.25)
    try:
        AuxLossScaler.apply(weights, aux).sum().backward()
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    assert aux.grad.item() == 0.25 and torch.equal(weights.grad, torch.ones(2, 2))
