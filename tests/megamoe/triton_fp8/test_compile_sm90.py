"""The blockwise-FP8 Triton kernels compile for Hopper (sm_90a) at the launches the CUDA path makes, on
the CPU, without spills (but one known bound).

The CPU tests run these kernels in the interpreter, which accepts what the GPU compiler can refuse and
says nothing about registers; this test compiles every distinct launch (``sm90_compile.py``) with the
ptxas Triton ships and checks spills and shared memory, in a fresh process (``TRITON_INTERPRET=1``,
set for the other CPU tests, replaces the kernels).
"""

from __future__ import annotations

from tests.megamoe.sm90 import assert_compiles_for_sm90

# ptxas's spill bytes today (a bound, so that growth is still caught): the weight quantiser's transposed
# read holds a [128, 128] fp32 block through a layout change; it runs once per optimizer step
KNOWN_SPILLS = {"quantize weight blocks, transposed view": 496}


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    assert_compiles_for_sm90("tests.megamoe.triton_fp8.sm90_compile", KNOWN_SPILLS)
