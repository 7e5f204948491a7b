"""MegaMoERouter equals megatron-core's TopKRouter: same experts, weights, aux loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.megamoe.megatron.models import moe_config, setup_megatron

ROUTER_CASES = {
    "softmax": dict(moe_router_score_function="softmax"),
    "softmax pre": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True),
    "sigmoid": dict(moe_router_score_function="sigmoid"),
    "sigmoid groups scaled (DeepSeek-V3)": dict(
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_topk=4,
    ),
    "softmax groups top-1 pre": dict(
        moe_router_pre_softmax=True, moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=1
    ),
    "no aux loss": dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"),
}


def _compare_all(rank, world):
    """One megatron process for every case: importing megatron-core costs seconds per process."""
    setup_megatron()
    return {name: _compare_routers(overrides) for name, overrides in ROUTER_CASES.items()}


def _compare_routers(overrides):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    from megamoe.megatron.moe_block import router_config_from
    from megamoe.megatron.options import MegaMoEOptions
    from megamoe.router import MegaMoERouter

    cfg = moe_config(num_moe_experts=8, **overrides)
    theirs = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    theirs.set_layer_number(1)
    ours = MegaMoERouter(router_config_from(cfg, MegaMoEOptions(enabled=True)), cfg.hidden_size)
    ours.weight.data.copy_(theirs.weight.data)
    ours.train()
    theirs.train()

    x = torch.randn(6, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    probs, routing_map = theirs(x_theirs)
    out = ours(x_ours.view(-1, cfg.hidden_size))
    dense = torch.zeros_like(probs).scatter(1, out.topk_idx, out.topk_weights)
    g = torch.randn(probs.shape, generator=torch.Generator().manual_seed(4))
    (probs * g).sum().backward()
    (dense * g).sum().backward()
    return {
        "map_equal": bool(
            torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, out.topk_idx, True))
        ),
        "probs": (probs - dense).abs().max().item(),
        "x_grad": (x_theirs.grad - x_ours.grad).abs().max().item(),
        "w_grad": (theirs.weight.grad - ours.weight.grad).abs().max().item(),
        "aux_is_none": out.aux_loss is None,
    }


@pytest.fixture(scope="module")
def router_results(tmp_path_factory):
    (results,) = run_ranks(_compare_all, 1, tmp_path_factory.mktemp("router"))
    return results


@pytest.mark.parametrize("name", ROUTER_CASES)
def test_router_matches_megatron_topk_router(name, router_results):
    overrides, res = ROUTER_CASES[name], router_results[name]
    assert res["map_equal"]
    assert res["probs"] < 1e-6
    assert res["x_grad"] < 1e-6 and res["w_grad"] < 1e-6, res
    assert res["aux_is_none"] == (overrides.get("moe_aux_loss_coeff", 1e-2) == 0.0)
