"""Every launch shape of the fused EP kernel compiles for Hopper (sm_90a), on the CPU.

The GPU compiler can refuse what the CPU interpreter runs: a flattened tile loop that holds a nested
loop or a branch crashed Triton 3.6's loop fusion on the H200 (an earlier tree). Triton compiles for
a ``GPUTarget`` without a GPU and ships ``ptxas``, so this test catches such failures, register
spills, and a tile loop that stops overlapping its gathered loads with the MMAs (a select on the
loop-carried expert did that once, silently: the forward dispatch ran 2.5x slower on the H200), in CI. It runs in a fresh process because ``TRITON_INTERPRET=1`` (set for the other CPU
tests) replaces the kernels with interpreted ones.
"""

from __future__ import annotations

import pytest

from tests.megamoe.sm90 import assert_compiles_for_sm90, assert_fits_beside
from tests.megamoe.symm.sm90_compile import BESIDE_GATHER, GATHER, PIPELINED


@pytest.mark.slow
def test_every_launch_compiles_for_sm90_without_spills_and_pipelined() -> None:
    report = assert_compiles_for_sm90("tests.megamoe.symm.sm90_compile", pipelined=tuple(PIPELINED))
    # broadcast mode's backward pool gather must fit on an SM beside the persistent dgrad program
    assert_fits_beside(report[GATHER], [report[name] for name in BESIDE_GATHER])
