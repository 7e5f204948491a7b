"""Experiment YAML resolution: extends chains, ${VAR} substitution, presets, strict structure."""

from __future__ import annotations

from pathlib import Path

import pytest

from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.train.loader import load_experiment, load_yaml, substitute


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_load_yaml_extends_merges_parents_in_order_then_the_file(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "x: 1\ny: 1\nnested: {p: 1, q: 1}\n")
    _write(tmp_path / "b.yaml", "y: 2\nz: 2\nnested: {q: 2}\n")
    child = _write(tmp_path / "c.yaml", "extends: [a.yaml, b.yaml]\nz: 3\n")
    assert load_yaml(child, {}) == {"x": 1, "y": 2, "z": 3, "nested": {"p": 1, "q": 2}}


def test_load_yaml_extends_cycle_is_an_error_naming_extends(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "extends: b.yaml\n")
    _write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(InvalidConfigError, match=r"^extends=.*cycle"):
        load_yaml(tmp_path / "a.yaml", {})


@pytest.mark.parametrize(
    ("text", "environ", "expected"),
    [
        ("${EP:8}", {}, 8),
        ("${EP:8}", {"EP": "16"}, 16),
        ("${LR:1.0e-5}", {}, 1.0e-5),
        ("${FLAG:true}", {}, True),
        ("${DATA:null}", {}, None),
        ("${NAME:run}", {}, "run"),
        ("${MODEL:deepseek_v3}.yaml", {"MODEL": "qwen3_30B_A3B"}, "qwen3_30B_A3B.yaml"),
        ("${LAYOUT:Et|tL}", {}, "Et|tL"),
        ("${REQ}", {"REQ": "present"}, "present"),
    ],
)
def test_substitute_env_vars_typed_when_whole_string(text: str, environ: dict, expected: object) -> None:
    assert substitute(text, environ, where="test") == expected


def test_substitute_required_var_missing_names_the_variable_and_file() -> None:
    with pytest.raises(
        InvalidConfigError, match=r"\$\{PRIMUS_TOKEN\}.*required environment variable.*exp\.yaml"
    ):
        substitute({"a": ["${PRIMUS_TOKEN}"]}, {}, where="exp.yaml")


def _experiment(tmp_path: Path, overrides: str = "", **module: str) -> Path:
    lines = "".join(f"    {k}: {v}\n" for k, v in module.items())
    body = "".join(f"      {line}\n" for line in overrides.splitlines())
    text = f"exp_name: e\nmodules:\n  pre_trainer:\n    framework: megatron\n{lines}    overrides:\n{body or '      {}'}\n"
    return _write(tmp_path / "exp.yaml", text)


def test_load_experiment_trainer_preset_wins_over_model_and_overrides_win_over_both(tmp_path: Path) -> None:
    _write(tmp_path / "trainer.yaml", "lr: 0.5\nnum_layers: 7\n")
    _write(tmp_path / "model.yaml", "num_layers: 3\nhidden_size: 32\n")
    path = _experiment(tmp_path, "hidden_size: 48", config="trainer.yaml", model="model.yaml")
    exp = load_experiment(path, {})
    assert exp.params == {"num_layers": 7, "hidden_size": 48, "lr": 0.5}
    assert exp.source["hidden_size"] == str(path)
    assert exp.identity == {"exp_name": "e"}


def test_load_experiment_finds_packaged_presets(tmp_path: Path) -> None:
    exp = load_experiment(_experiment(tmp_path, config="pre_trainer.yaml", model="deepseek_v3.yaml"), {})
    assert exp.params["num_experts"] == 256
    assert exp.params["mock_data"] is True  # pre_trainer.yaml
    assert exp.params["use_distributed_optimizer"] is True  # trainer_base.yaml, via extends


def test_load_experiment_unknown_preset_lists_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match=r"modules\.pre_trainer\.model=.*deepseek_v3_tiny\.yaml"):
        load_experiment(_experiment(tmp_path, model="deepseek_v4.yaml"), {})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "modules: {pre_trainer: {framework: megatron}}\nexp_nme: x\n",
            r"^exp_nme='x': unknown setting\. Use 'exp_name'",
        ),
        ("modules: {pre_trainer: {framework: megatron, overide: {}}}\n", r"^modules\.pre_trainer\.overide="),
        ("modules: {post_trainer: {framework: megatron}}\n", r"^modules\.pre_trainer="),
    ],
)
def test_load_experiment_structure_errors_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        load_experiment(_write(tmp_path / "exp.yaml", text), {})


def test_load_experiment_other_frameworks_are_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedSettingError, match=r"^modules\.pre_trainer\.framework='torchtitan'"):
        load_experiment(
            _write(tmp_path / "exp.yaml", "modules: {pre_trainer: {framework: torchtitan}}\n"), {}
        )
