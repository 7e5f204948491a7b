"""The profile script's command line; the profile itself needs a CUDA GPU (device machine only)."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.profile_layer import main


def test_dry_run_names_whose_expert_path_would_run() -> None:
    res = CliRunner().invoke(main, ["--model", "Qwen3-235B-A22B", "--impl", "sonic", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("would profile sonic, Qwen3-235B-A22B, uniform routing, bf16")


def test_a_peer_with_a_quantised_precision_is_refused_in_one_line() -> None:
    res = CliRunner().invoke(main, ["--impl", "torch", "--precision", "fp8", "--dry-run"])
    assert res.exit_code == 2
    assert "the peers run bf16 only, not fp8" in res.output
    assert "Traceback" not in res.output
