"""The benchmark scripts' kernels compile for Hopper (sm_90a) on the CPU, and each fits on a multiprocessor
beside a persistent dgrad program, as they run on the GPU: a variant that did not fit would measure the
GEMM waiting for it rather than the traffic beside it (``sm90_compile.py``)."""

from __future__ import annotations

from megamoe.backends.triton.side_gather import GATHER_MAX_REGISTERS
from tests.megamoe.sm90 import assert_compiles_for_sm90

# the loads-only variant keeps a [BLOCK_R, BLOCK_H] bf16 maximum live to keep its loads: 64 registers
# and a 16-byte spill (measured as such on the H200)
KNOWN_SPILLS = {"side gather variant loads only": 16}


def test_every_side_kernel_compiles_and_fits_beside_a_gemm() -> None:
    report = assert_compiles_for_sm90("tests.benchmarks.sm90_compile", known_spills=KNOWN_SPILLS)
    assert len(report) > 2
    for launch, result in report.items():
        assert result["registers"] <= GATHER_MAX_REGISTERS, f"{launch} does not fit beside a GEMM: {result}"
        assert result["shared"] <= 1024, f"{launch} takes shared memory a GEMM program needs: {result}"
