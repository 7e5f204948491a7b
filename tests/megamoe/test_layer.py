"""MegaMoELayer and its modules: EP-invariant init, expert-parallel tags, aux loss, shared expert."""

from __future__ import annotations

import pytest
import torch

from megamoe.errors import InvalidConfigError
from megamoe.layer import MegaMoEConfig, MegaMoEExperts, MegaMoELayer, MegaMoEWeightModule
from megamoe.router import RouterConfig
from tests._dist import run_ranks
from tests.megamoe.reference_math import dense_moe


def _layer_cfg(**overrides) -> MegaMoEConfig:
    router = RouterConfig(num_experts=6, topk=2, aux_loss_coeff=1e-2)
    fields = dict(hidden_size=8, ffn_hidden_size=4, router=router, seed=3, dtype=torch.float64)
    fields.update(overrides)
    return MegaMoEConfig(**fields)


def test_weight_module_forward_returns_its_parameter():
    module = MegaMoEWeightModule((2, 3), dtype=torch.float32)
    assert module() is module.weight
    assert module.weight.allreduce is False and module.weight.expert_parallel is True


def test_experts_keep_fc1_and_fc2_in_separate_modules():
    experts = MegaMoEExperts(num_experts=4, hidden_size=8, ffn_hidden_size=4)
    assert experts.fc1_weight.shape == (4, 8, 8) and experts.fc2_weight.shape == (4, 8, 4)
    assert experts.fc1 is not experts.fc2
    assert [n for n, _ in experts.named_parameters()] == ["fc1.weight", "fc2.weight"]


def test_layer_output_matches_dense_oracle_plus_shared_expert():
    torch.manual_seed(0)
    layer = MegaMoELayer(_layer_cfg(shared_expert_intermediate_size=6))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y, aux = layer(x)
    x_TH = x.view(-1, 8)
    routing = layer.router(x_TH)
    expected = dense_moe(
        x_TH,
        routing.topk_idx,
        routing.topk_weights.double(),
        layer.experts.fc1_weight,
        layer.experts.fc2_weight,
    ) + layer.shared_expert(x_TH)
    torch.testing.assert_close(y.view(-1, 8), expected)
    assert aux is not None and aux.ndim == 0 and aux.item() > 0


def test_aux_loss_gradient_reaches_router_without_adding_it_to_the_loss():
    layer = MegaMoELayer(_layer_cfg())
    x = torch.randn(16, 8, dtype=torch.float64)
    y, aux = layer(x)
    y.sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.router.cfg = RouterConfig(num_experts=6, topk=2, aux_loss_coeff=0.0)
    y, aux = layer(x)
    y.sum().backward()
    assert aux is None
    assert not torch.allclose(with_aux, layer.router.weight.grad)


def _local_expert_weights(rank, world):
    import torch.distributed as dist

    layer = MegaMoELayer(_layer_cfg(), ep_group=dist.group.WORLD)
    return layer.experts.first_expert, layer.experts.fc1_weight.detach(), layer.experts.fc2_weight.detach()


def test_expert_init_is_the_same_whatever_the_ep_size(tmp_path):
    single = MegaMoELayer(_layer_cfg())
    for first, fc1, fc2 in run_ranks(_local_expert_weights, 2, tmp_path):
        local = slice(first, first + fc1.shape[0])
        torch.testing.assert_close(fc1, single.experts.fc1_weight.detach()[local], rtol=0, atol=0)
        torch.testing.assert_close(fc2, single.experts.fc2_weight.detach()[local], rtol=0, atol=0)


def _indivisible(rank, world):
    import torch.distributed as dist

    try:
        MegaMoEExperts(num_experts=5, hidden_size=8, ffn_hidden_size=4, ep_group=dist.group.WORLD)
    except InvalidConfigError as e:
        return str(e)
    return "no error"


def test_experts_not_divisible_by_ep_size_is_a_named_error(tmp_path):
    for message in run_ranks(_indivisible, 2, tmp_path):
        assert message.startswith("num_moe_experts=5: not divisible by the EP size 2")


@pytest.mark.parametrize("mode", ["even", "uniform"])
def test_forced_balancing_routes_evenly_or_randomly(mode):
    cfg = _layer_cfg(router=RouterConfig(num_experts=4, topk=2, force_load_balancing=mode))
    layer = MegaMoELayer(cfg)
    x = torch.randn(8, 8, dtype=torch.float64)
    routing = layer.router(x)
    counts = torch.bincount(routing.topk_idx.flatten(), minlength=4)
    if mode == "even":
        assert counts.tolist() == [4, 4, 4, 4]
        assert torch.all(routing.topk_weights[:, 0] >= routing.topk_weights[:, 1])
    y, _ = layer(x)
    y.sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
