"""MegaMoE inside a megatron-core GPTModel equals megatron's own MoELayer: same init, loss and grads."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.megamoe.megatron.models import (
    batch,
    build_gpt,
    expert_weights_of_baseline,
    moe_config,
    setup_megatron,
)

MODEL_CASES = {
    "softmax aux loss": dict(),
    "DeepSeek-V3 routing + shared expert": dict(
        moe_router_score_function="sigmoid",
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=8,
        moe_layer_freq=[0, 1],
    ),
}


def _loss_and_grads(model, data):
    tokens, position_ids, mask, labels = data
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _parity(rank, world, overrides):
    setup_megatron(ep=world)
    cfg = moe_config(expert_model_parallel_size=world, **overrides)
    baseline = build_gpt(cfg, mega=False)
    mega = build_gpt(cfg, mega=True)
    mega_params = dict(mega.named_parameters())
    init_diff = max(
        (mega_params[n] - w).abs().max().item() for n, w in expert_weights_of_baseline(baseline).items()
    )
    data = batch(seed=10 + rank)
    loss_b, grads_b = _loss_and_grads(baseline, data)
    loss_m, grads_m = _loss_and_grads(mega, data)
    stacked = {n: g for n, g in expert_weights_of_baseline(_GradView(baseline)).items()}
    grad_diff = {}
    for name, g in grads_m.items():
        ref = stacked.get(name, grads_b.get(name))
        grad_diff[name] = (g - ref).abs().max().item()
    return {"init": init_diff, "loss": abs(loss_b - loss_m), "grads": grad_diff, "n_grads": len(grads_b)}


class _GradView:
    """Presents a model's expert *gradients* where expert_weights_of_baseline reads weights."""

    def __init__(self, model):
        self.model = model

    def named_modules(self):
        for name, module in self.model.named_modules():
            if hasattr(module, "local_experts"):
                yield name, _Experts(module)


class _Experts:
    def __init__(self, module):
        self.local_experts = [_Grads(e) for e in module.local_experts]


class _Grads:
    def __init__(self, expert):
        self.linear_fc1 = type("W", (), {"weight": expert.linear_fc1.weight.grad})
        self.linear_fc2 = type("W", (), {"weight": expert.linear_fc2.weight.grad})


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["EP=1", "EP=2"])
@pytest.mark.parametrize("case", MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_gpt_with_mega_moe_matches_megatron_moe_layer(case, world, tmp_path):
    results = run_ranks(_parity, world, tmp_path, case)
    for rank, res in enumerate(results):
        assert res["init"] == 0.0, f"rank {rank}: MegaMoE init differs from MoELayer's"
        assert res["loss"] < 1e-6, f"rank {rank}: loss differs by {res['loss']:.3e}"
        assert len(res["grads"]) >= 10
        worst = max(res["grads"], key=res["grads"].get)
        assert res["grads"][worst] < 1e-5, (
            f"rank {rank}: grad of {worst} differs by {res['grads'][worst]:.3e}"
        )
