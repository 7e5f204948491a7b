"""CLI overrides: every form and every value type lands typed by the field it sets."""

from __future__ import annotations

import pytest

from megamoe.errors import InvalidConfigError
from megamoe.train.convert import build_config
from megamoe.train.overrides import apply_overrides, parse_overrides

LAYOUT = "Ett|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL"


def _params(*argv: str) -> dict:
    _, params = apply_overrides({}, {}, parse_overrides(argv))
    return build_config({}, params).params()


@pytest.mark.parametrize(
    ("argv", "key", "expected"),
    [
        (["--num_layers", "4"], "num_layers", 4),
        (["--num_layers=4"], "num_layers", 4),
        (["--lr", "1e-4"], "lr", 1e-4),
        (["--lr", "1.0e-5"], "lr", 1.0e-5),
        (["--lr", "3"], "lr", 3.0),
        (["--enable_primus_turbo", "True"], "enable_primus_turbo", True),
        (["--use_turbo_mega_moe=false"], "use_turbo_mega_moe", False),
        (["--mock_data"], "mock_data", True),
        (["--moe_shared_expert_intermediate_size", "None"], "moe_shared_expert_intermediate_size", None),
        (["--pipeline_model_parallel_layout", "null"], "pipeline_model_parallel_layout", None),
        (["--recompute_granularity", "null"], "recompute_granularity", None),
        (["--recompute_granularity", "full"], "recompute_granularity", "full"),
        (["--recompute_layer_ids", "null"], "recompute_layer_ids", None),
        (["--recompute_layer_ids", "0,3,4"], "recompute_layer_ids", [0, 3, 4]),
        (["--recompute_layer_ids", "[1, 2]"], "recompute_layer_ids", [1, 2]),
        (["--pipeline_model_parallel_layout", LAYOUT], "pipeline_model_parallel_layout", LAYOUT),
        (["--pipeline_model_parallel_layout", "Et*3|t*3,L"], "pipeline_model_parallel_layout", "Et*3|t*3,L"),
        (["--moe_layer_freq", "1"], "moe_layer_freq", 1),
        (["--moe_layer_freq", "([0]*3+[1]*58)"], "moe_layer_freq", [0] * 3 + [1] * 58),
        (["--moe_layer_freq", "[0,1,1]"], "moe_layer_freq", [0, 1, 1]),
        (
            ["--moe_router_force_load_balancing_type", "uniform"],
            "moe_router_force_load_balancing_type",
            "uniform",
        ),
        (["--lr_decay_style", "COSINE"], "lr_decay_style", "cosine"),
        (["--turbo_mega_moe_precision", "fp8"], "turbo_mega_moe_precision", "fp8"),
        (["--tokenizer_type", "123"], "tokenizer_type", "123"),
        (["--moe_router_topk_scaling_factor", "2.5"], "moe_router_topk_scaling_factor", 2.5),
        (["--clip_grad", "-1"], "clip_grad", -1.0),
        (["--train_iters", "2e3"], "train_iters", 2000),
    ],
)
def test_override_value_is_typed_by_its_field(argv: list[str], key: str, expected: object) -> None:
    value = _params(*argv)[key]
    assert value == expected
    assert type(value) is type(expected)


def test_override_later_value_wins() -> None:
    assert _params("--num_layers", "4", "--num_layers=6")["num_layers"] == 6


def test_override_identity_keys_set_the_experiment_folder() -> None:
    identity, _ = apply_overrides({"workspace": "./output"}, {}, parse_overrides(["--workspace", "/tmp/w"]))
    assert identity == {"workspace": "/tmp/w"}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--num_layer", "4"], r"^num_layer='4': unknown setting\. Use 'num_layers'"),
        (["--moe_router_force_load_balancing_typ", "even"], r"Use 'moe_router_force_load_balancing_type'"),
        (["--zzz", "1"], r"^zzz='1': unknown setting\. docs/training\.md"),
        (["--num_layers"], r"^num_layers=None: needs a value"),
        (["--num_layers", "four"], r"^num_layers='four': expected an integer"),
        (["--num_layers", "4.5"], r"^num_layers='4.5': expected an integer"),
        (["--mock_data", "maybe"], r"^mock_data='maybe': expected a boolean"),
        (["--lr", "fast"], r"^lr='fast': expected a number"),
        (["--lr", "null"], r"^lr=None: null is not allowed"),
        (["--lr_decay_style", "cosin"], r"^lr_decay_style='cosin': must be one of .* Use 'cosine'"),
        (
            ["--turbo_mega_moe_precision", "fp4"],
            r"^turbo_mega_moe_precision='fp4': must be one of bf16, mxfp8, fp8",
        ),
        (["--moe_layer_freq", "[0]*2+[2]"], r"^moe_layer_freq=.*only 0 \(dense\) and 1 \(MoE\)"),
        (["--moe_layer_freq", "__import__('os')"], r"^moe_layer_freq=.*not an int or a list expression"),
        (["num_layers", "4"], r"^override='num_layers': expected --key value"),
    ],
)
def test_override_errors_name_the_setting(argv: list[str], match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        _params(*argv)
