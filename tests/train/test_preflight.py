"""`python -m megamoe.train check`: one JSON verdict on a pretrain config for a world size, exit 0 or 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from megamoe.train.preflight import check

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "configs" / "cpu"
MOCK = str(CONFIGS / "moe_tiny-mock-pretrain.yaml")


def _check(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(check, list(args), catch_exceptions=False)
    [line] = res.output.splitlines()
    return res.exit_code, json.loads(line)


def test_check_accepts_a_config_and_names_its_run_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PRIMUS_TEAM", "PRIMUS_USER", "PRIMUS_EXP_NAME", "PRIMUS_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    code, verdict = _check("--world-size", "2", "--no-cuda", "--config", MOCK)
    assert code == 0
    assert verdict["ok"] is True
    assert verdict["output_dir"].endswith("/megamoe/demo/moe_tiny-mock-pretrain")
    assert (verdict["world_size"], verdict["data_parallel_size"]) == (2, 2)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--expert_model_parallel_size", "3"],
            "num_experts=8: not divisible by expert_model_parallel_size=3.",
        ),
        (["--num_layer", "3"], "num_layer='3': unknown setting. Use 'num_layers', the closest known key."),
    ],
    ids=["ep-does-not-divide", "misspelt-key"],
)
def test_check_rejects_a_config_that_cannot_start_with_its_one_line_message(
    args: list[str], error: str
) -> None:
    code, verdict = _check("--world-size", "2", "--no-cuda", "--config", MOCK, *args)
    assert code == 2
    assert verdict["ok"] is False and verdict["error"].startswith(error)
    assert "\n" not in verdict["error"]


def test_check_judges_for_the_world_size_it_is_given() -> None:
    code, verdict = _check("--world-size", "3", "--no-cuda", "--config", MOCK)
    assert code == 2 and "does not divide the world size 3" in verdict["error"]


def test_check_takes_every_argument_of_pretrain(tmp_path: Path) -> None:
    export = tmp_path / "effective.yaml"
    code, _ = _check(
        "--world-size", "2", "--no-cuda", "--config", MOCK, "--export_config", str(export), "--dry-run"
    )
    assert code == 0
    assert not export.exists()  # checking writes nothing


def test_check_is_a_megamoe_train_command_that_never_imports_megatron() -> None:
    argv = [sys.executable, "-X", "importtime", "-m", "megamoe.train", "check", "--world-size", "2", "--no-cuda",
            "--config", MOCK, "--expert_model_parallel_size", "3"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert json.loads(res.stdout)["ok"] is False
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()}
    assert not any(name.startswith("megatron") for name in imported)
