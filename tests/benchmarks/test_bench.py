"""The benchmark's CLI on a machine without a GPU: dry run, option errors, and the missing-GPU error."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from benchmarks.bench import main


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


def test_bench_fp8_is_layer_mode_and_times_fp8_mxfp8_and_bf16():
    from benchmarks import bench

    runner = CliRunner()
    result = runner.invoke(main, ["--models", "DeepSeek-V3", "--precision", "fp8", "--dry-run"])
    assert result.exit_code == 0 and "precision=fp8" in result.output, result.output
    result = runner.invoke(main, ["--precision", "fp8", "--mode", "dispatch_grouped_gemm", "--dry-run"])
    assert result.exit_code == 2 and "fp8 is benchmarked in --mode layer only" in result.output, result.output
    result = runner.invoke(main, ["--precision", "fp8", "--num-processes", "2", "--dry-run"])
    assert result.exit_code == 0 and "num_processes=2" in result.output, result.output
    x = torch.zeros(4, 16)
    inputs = (
        x,
        torch.zeros(4, 2, dtype=torch.long),
        torch.ones(4, 2),
        torch.zeros(2, 32, 16),
        torch.zeros(2, 16, 16),
    )
    assert [impl for impl, _, _ in bench._cases("layer", inputs, "fp8")] == ["megamoe", "mxfp8", "baseline"]
    assert [impl for impl, _, _ in bench._cases("layer", inputs, "mxfp8")] == ["megamoe", "baseline"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_bench_without_gpu_says_so():
    result = CliRunner().invoke(main, ["--models", "Qwen3-30B-A3B"])
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels under the CPU interpreter")
@pytest.mark.parametrize("mode", ["dispatch_grouped_gemm", "grouped_gemm_combine", "layer"])
def test_bench_cases_run_forward_backward_and_ours_runs_no_swiglu_pass(mode, monkeypatch):
    """Stage 1 computes SwiGLU in GEMM1's epilogue and stage 2 takes it: no separate SwiGLU pass is
    timed in any mode (tiny bf16 shape, Triton kernels under the interpreter)."""
    from benchmarks import bench
    from megamoe.backends.triton import ops

    passes = []
    monkeypatch.setattr(ops, "swiglu_forward", lambda *args: passes.append(args))
    shape = bench.ModelShape(hidden=32, inter=24, experts=4, topk=2, tokens=24)
    for impl, forward, leaves in bench._cases(mode, bench._inputs(shape, "skewed", torch.device("cpu"))):
        for _ in range(2):  # the benchmark repeats each case on the same leaves
            out = forward()
            torch.autograd.backward(out, torch.randn_like(out), inputs=leaves)
        assert all(leaf.grad is not None for leaf in leaves), impl
    assert passes == []


def test_bench_cached_weights_is_for_quantised_precisions():
    runner = CliRunner()
    result = runner.invoke(
        main, ["--models", "DeepSeek-V3", "--precision", "fp8", "--cached-weights", "--dry-run"]
    )
    assert result.exit_code == 0 and "cached_weights=True" in result.output, result.output
    result = runner.invoke(main, ["--cached-weights", "--dry-run"])
    assert result.exit_code == 2 and "use --precision mxfp8 or fp8" in result.output, result.output
    result = runner.invoke(
        main, ["--precision", "mxfp8", "--cached-weights", "--num-processes", "2", "--dry-run"]
    )
    assert result.exit_code == 2 and "one GPU only" in result.output, result.output


def test_each_peak_is_measured_with_no_gradient_left_on_any_leaf(monkeypatch):
    """The timed rounds leave ``.grad`` on the (shared) leaves; a peak taken then would not count the
    weight gradients that autograd adds in place into them. Every implementation's peak is taken with no
    gradient on any leaf (the timing and the peak are stubbed: no GPU here)."""
    from benchmarks import bench

    x, w1 = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, 2, requires_grad=True)

    def forward():
        return x * w1

    cases = [("megamoe", forward, [x, w1]), ("baseline", forward, [x, w1])]
    grads_at_peak = []

    def timed_rounds(timed):
        for fn, _ in timed:
            fn()  # leaves .grad set, as the timed rounds do
        return [1.0] * len(timed)

    def peak(fn):
        grads_at_peak.append([leaf.grad is not None for leaf in (x, w1)])
        fn()
        return 0.0

    monkeypatch.setattr(bench, "time_interleaved", timed_rounds)
    monkeypatch.setattr(bench, "peak_gib", peak)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    results = bench._time_cases(
        "layer",
        "tiny",
        bench.ModelShape(hidden=2, inter=2, experts=2, topk=1, tokens=2),
        "uniform",
        cases,
        False,
    )
    assert [r.impl for r in results] == ["megamoe", "baseline"] * 2
    assert grads_at_peak == [[False, False]] * 4
