"""The benchmark's CLI on a machine without a GPU: dry run, option errors, and the missing-GPU error."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from megamoe.bench import main


def test_bench_dry_run_lists_cases_without_a_gpu():
    result = CliRunner().invoke(main, ["--models", "DeepSeek-V3", "--precision", "mxfp8", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "layer DeepSeek-V3" in result.output and "'tokens': 8192" in result.output
    assert "precision=mxfp8" in result.output


def test_bench_rejects_unknown_model_and_mxfp8_stage_modes():
    runner = CliRunner()
    assert "unknown model" in runner.invoke(main, ["--models", "GPT-5", "--dry-run"]).output
    result = runner.invoke(main, ["--mode", "grouped_gemm_combine", "--precision", "mxfp8", "--dry-run"])
    assert result.exit_code == 2 and "--mode layer only" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_bench_without_gpu_says_so():
    result = CliRunner().invoke(main, ["--models", "Qwen3-30B-A3B"])
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output
