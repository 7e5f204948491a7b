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
