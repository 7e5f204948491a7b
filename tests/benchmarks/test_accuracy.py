"""The accuracy CLI: its figures, its --dry-run and its error for a bad option."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from benchmarks.accuracy import cosine, main, snr_db

TINY = ["--tokens", "64", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2"]


def test_snr_db_and_cosine_hand_computed():
    ref = torch.tensor([3.0, 4.0])
    assert snr_db(ref + torch.tensor([0.3, 0.4]), ref) == pytest.approx(20.0, abs=1e-5)  # noise: a tenth
    assert snr_db(ref, ref) == float("inf")
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == 0.0


def test_accuracy_cli_reports_mxfp8_between_20_and_30_db():
    result = CliRunner().invoke(main, [*TINY, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["report"]
    assert set(report) == {"bf16 vs float64", "mxfp8 vs float64", "mxfp8 vs bf16"}
    for name in ("y", "dx", "dw1", "dw2"):
        assert report["bf16 vs float64"][f"{name} snr_db"] > 40
        assert 20 < report["mxfp8 vs float64"][f"{name} snr_db"] < 30
        assert report["mxfp8 vs bf16"][f"{name} cos"] > 0.99


def test_accuracy_cli_reports_fp8_between_20_and_30_db():
    result = CliRunner().invoke(main, [*TINY, "--hidden", "256", "--precision", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["report"]
    assert set(report) == {"bf16 vs float64", "fp8 vs float64", "fp8 vs bf16"}
    for name in ("y", "dx", "dw1", "dw2"):
        assert 20 < report["fp8 vs float64"][f"{name} snr_db"] < 30


def test_accuracy_cli_markdown_table():
    result = CliRunner().invoke(main, TINY)
    assert result.exit_code == 0, result.output
    assert "| mxfp8 vs bf16 |" in result.output and result.output.startswith("T=64 H=64 I=32 E=4 K=2 seed=0")


def test_accuracy_cli_dry_run_computes_nothing():
    result = CliRunner().invoke(main, [*TINY, "--dry-run", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        "backend": "reference",
        "device": "cuda",
        "precision": "mxfp8",
        "problem": {"experts": 4, "hidden": 64, "inter": 32, "seed": 0, "tokens": 64, "topk": 2},
    }


def test_accuracy_cli_topk_above_experts_is_a_usage_error():
    result = CliRunner().invoke(main, ["--experts", "4", "--topk", "5"])
    assert result.exit_code == 2 and "--topk" in result.output and "set --topk <= 4" in result.output
