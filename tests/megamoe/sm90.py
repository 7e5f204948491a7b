"""Shared check of the ``test_compile_sm90`` tests: a package's kernels compile for Hopper (sm_90a) on the CPU.

Each package has an ``sm90_compile`` module that compiles its kernels' CUDA launches with Triton's
``GPUTarget`` and the ``ptxas`` Triton ships, and prints a JSON report. It runs in a fresh process
because ``TRITON_INTERPRET=1`` (set for the other CPU tests) replaces ``@triton.jit`` kernels with
interpreted ones, which cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use


def assert_compiles_for_sm90(
    module: str, known_spills: dict[str, int] | None = None, pipelined: tuple[str, ...] = ()
) -> dict:
    """Run ``python -m module`` and check every launch compiled, within shared memory, spilling no more
    than ``known_spills`` (bytes by launch name; none for the others), and the ``pipelined`` launches
    keep gathered loads in flight across their MMAs. Returns the report (launch name: its result)."""
    known_spills = known_spills or {}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600
    )
    assert out.returncode == 0, f"{module} failed:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout)
    assert report, "no launch was compiled"
    for launch, result in report.items():
        assert result["compiled"], f"{launch}: {result.get('error')}"
        assert result["spill_bytes"] <= known_spills.get(launch, 0), f"{launch} spills: {result}"
        assert result["shared"] <= SMEM_LIMIT, f"{launch} needs too much shared memory: {result}"
    for launch in pipelined:
        assert report[launch]["cp_async_in_flight"] >= 1, (
            f"{launch}: gathered loads not pipelined: {report[launch]}"
        )
    return report


def assert_fits_beside(gather: dict, gemms: list[dict], warps: int | None = None) -> None:
    """A side gather's program of ``warps`` warps (``megamoe.backends.triton.side_gather``'s by default) fits
    on an SM beside each persistent 8-warp GEMM program: registers (allocated per thread in steps of 8)
    and shared memory."""
    from megamoe.backends.triton.side_gather import GEMM_REGISTER_CAP, NUM_WARPS

    warps = warps or NUM_WARPS
    max_registers = (65536 - 256 * GEMM_REGISTER_CAP) // (32 * warps)
    assert gather["registers"] <= max_registers, f"the gather needs too many registers: {gather}"
    for gemm in gemms:
        assert gemm["registers"] <= GEMM_REGISTER_CAP, f"a GEMM a gather runs beside is over the cap: {gemm}"
        registers = 256 * -(-gemm["registers"] // 8) * 8 + 32 * warps * gather["registers"]
        assert registers <= 65536, (
            f"gather and GEMM need {registers} registers of an SM's 65536: {gather}, {gemm}"
        )
        assert gather["shared"] + gemm["shared"] + 2048 <= SMEM_LIMIT + 1024, (gather, gemm)
