"""The MegaMoE switch: when it replaces MoELayer, and the settings it refuses at build time."""

from __future__ import annotations

import pytest

from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from tests._dist import run_ranks
from tests.megamoe.megatron.models import moe_config, replace, setup_megatron

UNSUPPORTED = {
    "tensor_model_parallel_size": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "add_bias_linear": dict(add_bias_linear=True),
    "activation": dict(gated_linear_unit=False),
    "moe_expert_capacity_factor": dict(moe_expert_capacity_factor=1.0),
    "moe_router_load_balancing_type": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "moe_z_loss_coeff": dict(moe_z_loss_coeff=1e-3),
    "moe_input_jitter_eps": dict(moe_input_jitter_eps=0.01),
    "moe_router_enable_expert_bias": dict(
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"
    ),
}
UNSUPPORTED_VIA_REPLACE = {
    "moe_router_load_balancing_type=global": ("moe_router_load_balancing_type", "global_aux_loss"),
    "moe_router_load_balancing_type=sinkhorn": ("moe_router_load_balancing_type", "sinkhorn"),
}


def _decide_all(rank, world):
    from megamoe.megatron import MegaMoEOptions, decide_mega_moe

    setup_megatron()
    on = MegaMoEOptions(enabled=True)
    outcome = {}
    for name, overrides in UNSUPPORTED.items():
        try:
            cfg = moe_config(**overrides)
        except Exception as e:  # megatron itself refused the combination
            outcome[name] = ("megatron", str(e))
            continue
        try:
            decide_mega_moe(cfg, on)
            outcome[name] = ("accepted", "")
        except UnsupportedSettingError as e:
            outcome[name] = ("refused", e.setting, str(e))
    for name, (field, value) in UNSUPPORTED_VIA_REPLACE.items():
        cfg = replace(moe_config(), **{field: value})
        try:
            decide_mega_moe(cfg, on)
            outcome[name] = ("accepted", "")
        except UnsupportedSettingError as e:
            outcome[name] = ("refused", e.setting, str(e))
    supported = decide_mega_moe(moe_config(), on)
    off = decide_mega_moe(moe_config(), MegaMoEOptions(enabled=False))
    dense = decide_mega_moe(moe_config(num_moe_experts=None, moe_ffn_hidden_size=None), on)
    fp8 = decide_mega_moe(moe_config(), MegaMoEOptions(enabled=True, precision="fp8"))
    return (
        outcome,
        (supported.use, supported.reason),
        (off.use, off.reason),
        (dense.use, dense.reason),
        (fp8.use, fp8.reason),
    )


@pytest.fixture(scope="module")
def decisions(tmp_path_factory):
    (result,) = run_ranks(_decide_all, 1, tmp_path_factory.mktemp("decide"))
    return result


@pytest.mark.parametrize("setting", [*UNSUPPORTED, *UNSUPPORTED_VIA_REPLACE])
def test_decide_mega_moe_refuses_unsupported_setting_naming_it(setting, decisions):
    outcome = decisions[0][setting]
    assert outcome[0] == "refused", outcome
    expected = setting.split("=")[0]
    assert outcome[1] == expected and outcome[2].startswith(f"{expected}="), outcome


def test_decide_mega_moe_replaces_when_all_conditions_hold(decisions):
    use, reason = decisions[1]
    assert use and "TP=1" in reason and "EP=1" in reason and "float32 params" in reason


def test_decide_mega_moe_names_the_fp8_emulation(decisions):
    use, reason = decisions[4]
    assert use and reason.endswith("precision=fp8 (exact emulation)")


def test_decide_mega_moe_off_or_dense_keeps_megatron(decisions):
    assert decisions[2][0] is False and "MoELayer" in decisions[2][1]
    assert decisions[3][0] is False and "no MoE layers" in decisions[3][1]


def test_options_reject_unknown_values():
    from megamoe.megatron import MegaMoEOptions

    with pytest.raises(InvalidConfigError, match=r"^turbo_mega_moe_precision='fp4'"):
        MegaMoEOptions(enabled=True, precision="fp4")
    with pytest.raises(InvalidConfigError, match=r"^moe_router_force_load_balancing_type='random'"):
        MegaMoEOptions(enabled=True, force_load_balancing="random")
