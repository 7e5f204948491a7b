"""``benchmarks.bench_ep``'s bookkeeping on the CPU: which leg's time lands in which column (the timings
themselves need GPUs; test_gpu_symm.py and docs/benchmarks.md have those)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import bench_ep
from benchmarks.bench_ep import OpLegs, StageResult, format_stages
from megamoe.settings import SymmSettings


def _op(stage: str, variants: tuple = ()) -> OpLegs:
    def leg(name):
        def fn():
            return name

        fn.leg = f"{stage}/{name}"
        return fn

    variants = tuple((label, leg(f"{label} full"), leg(f"{label} comm")) for label in variants)
    return OpLegs(stage, leg("full"), leg("comm"), leg("gemm"), leg("serial"), variants)


@pytest.fixture
def timed(monkeypatch):
    """bench_stages over two fake ops; every leg's 'time' is its position in the timed list + 1."""
    ops = [_op("fwd: dispatch + GEMM1", ("plan reused",)), _op("fwd: GEMM2 + combine")]
    calls: list[list[str]] = []
    ws = SimpleNamespace(settings=SymmSettings())  # the workspace whose dispatch mode the legs switch

    def interleaved(fns, **_):
        calls.append([ws.settings.dispatch, *(f.leg for f in fns)])
        return [float(i + 1) for i in range(len(fns))]

    monkeypatch.setattr(bench_ep, "op_legs", lambda *a: (ops, lambda: None, ["push", "broadcast"], ws))
    monkeypatch.setattr(bench_ep, "time_collective_interleaved", interleaved)
    monkeypatch.setattr(bench_ep, "time_collective", lambda fn, **_: 9.0)
    results = bench_ep.bench_stages("M", None, "uniform", None, "grouped_gemm_combine")
    assert ws.settings == SymmSettings(), "the workspace's own settings are back after the legs"
    return results, [c[1:] for c in calls], [c[0] for c in calls]


def test_every_leg_lands_in_its_column_and_variants_share_the_gemm_and_serial_legs(timed) -> None:
    results, calls, _ = timed
    by_stage = {r.stage: r for r in results}
    push = by_stage["fwd: dispatch + GEMM1 [push]"]
    assert (push.comm_ms, push.gemm_ms, push.measured_ms, push.serial_ms) == (1.0, 2.0, 3.0, 4.0)
    reused = by_stage["fwd: dispatch + GEMM1 [push], plan reused"]
    assert (reused.comm_ms, reused.gemm_ms, reused.measured_ms, reused.serial_ms) == (6.0, 2.0, 5.0, 4.0)
    assert calls[0][4:] == [
        "fwd: dispatch + GEMM1/plan reused full",
        "fwd: dispatch + GEMM1/plan reused comm",
    ]


def test_ops_that_move_no_rows_to_the_experts_are_timed_once_and_the_wgrads_last(timed) -> None:
    results, _, modes = timed
    assert modes == ["push", "push", "broadcast"]  # the ops that move rows, in each mode; the rest once
    stages = [r.stage for r in results]
    assert stages.count("fwd: GEMM2 + combine") == 1  # not once per dispatch mode
    assert "fwd: dispatch + GEMM1 [broadcast], plan reused" in stages
    assert stages[-1] == "bwd wgrad: dW1 + dW2 (local)"
    assert results[-1].measured_ms == 9.0


def test_overlap_and_speedup_and_their_table() -> None:
    r = StageResult("DeepSeek-V3", "uniform", "fwd: GEMM2 + combine", 1.5, 3.0, 3.2, 6.4)
    assert r.overlap == pytest.approx(3.0 / 3.2)
    assert r.speedup == pytest.approx(2.0)
    table = format_stages([r])
    assert (
        "| DeepSeek-V3 | uniform | fwd: GEMM2 + combine | 1.500 | 3.000 | 3.200 | 93.8% | 6.400 | 2.00x |"
        in table
    )


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp8"])
def test_layer_mode_times_each_precision_over_its_transports_beside_the_nccl_pipeline(
    monkeypatch, precision
) -> None:
    """Which ``fused_mega_moe`` calls each leg makes (precision, transport: FP8 over both of its
    transports), timed in one interleaved comparison with the NCCL pipeline; the GPU timings are
    docs/benchmarks.md's. The inputs are CPU tensors and the op a stand-in: only the bookkeeping runs."""
    import torch

    import megamoe
    from benchmarks.common import MODELS

    shape = MODELS["Qwen3-30B-A3B"]
    monkeypatch.setattr(bench_ep.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(bench_ep.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(
        bench_ep,
        "rank_inputs",
        lambda *a: (torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2),
                    torch.zeros(1, 6, 8), torch.zeros(1, 8, 3)),
    )  # fmt: skip
    calls: list[tuple[str, str]] = []

    def fused(x, idx, tw, w1, w2, *, group, backend, precision, settings):
        assert backend == "triton"
        calls.append((precision, settings.transport))
        return x * 2 + tw.sum() + w1.sum() + w2.sum()

    monkeypatch.setattr(megamoe, "fused_mega_moe", fused)
    monkeypatch.setattr(
        bench_ep, "baseline_ep_layer", lambda x, *a: calls.append(("nccl pipeline", "")) or x * 3
    )
    monkeypatch.setattr(bench_ep, "_max_peak_gib", lambda fn: 0.5)
    timed: list[int] = []

    def interleaved(fns, **_):
        timed.append(len(fns))
        for fn in fns:
            fn()
        return [float(i + 1) for i in range(len(fns))]

    monkeypatch.setattr(bench_ep, "time_collective_interleaved", interleaved)
    results = bench_ep.bench_layer("Qwen3-30B-A3B", shape, "uniform", None, precision)
    legs = {
        "bf16": [("bf16", "symm")],
        "mxfp8": [("bf16", "symm"), ("mxfp8", "symm")],
        "fp8": [("bf16", "symm"), ("fp8", "symm"), ("fp8", "nccl")],
    }[precision]
    assert calls == [*legs, ("nccl pipeline", "")] and timed == [len(legs) + 1]
    names = [r.impl for r in results]
    assert names[-1] == "NCCL all-to-all + torch._grouped_mm" and len(set(names)) == len(names)
    if precision == "fp8":
        assert names[1:3] == ["megamoe fp8 (symmetric memory)", "megamoe fp8 (NCCL all-to-all)"]
    table = bench_ep.format_layers(results)
    assert f"| {names[0]} | 1.000 |" in table and f"| {names[-1]} | {len(names)}.000 |" in table
