"""The MXFP8 Triton kernels compile for Hopper (sm_90a) at the launches the CUDA path makes, on the CPU.

The CPU tests run these kernels in the interpreter, which accepts what the GPU compiler can refuse and
says nothing about registers; the MX GEMMs run at the register limit (255 per thread, two one-warpgroup
programs per SM), so a small change can make them spill. Triton compiles for a ``GPUTarget`` without a
GPU and ships ``ptxas``, so this test compiles every distinct launch (``sm90_compile.py``: the M-grouped
GEMM gathered and by TMA, the K-grouped wgrad, the quantisers, the SwiGLU passes) and checks spills and
shared memory. It runs in a fresh process because ``TRITON_INTERPRET=1`` (set for the other CPU tests)
replaces the kernels.
"""

from __future__ import annotations

from tests.megamoe.sm90 import assert_compiles_for_sm90


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    assert_compiles_for_sm90("tests.megamoe.triton_mx.sm90_compile")
