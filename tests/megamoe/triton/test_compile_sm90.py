"""The one-GPU bf16 Triton kernels compile for Hopper (sm_90a) at the launches the CUDA path makes, on the CPU.

The CPU tests run these kernels in the interpreter, which accepts what the GPU compiler can refuse (a
branch or nested loop in a flattened persistent loop, a layout conversion that needs more shared memory
than a block has) and says nothing about registers. Triton compiles for a ``GPUTarget`` without a GPU
and ships ``ptxas``, so this test compiles every distinct launch (``sm90_compile.py``: the five
grouped-GEMM forms, wgrad, SwiGLU, combine, padding, routing) and checks spills and shared memory. It
runs in a fresh process because ``TRITON_INTERPRET=1`` (set for the other CPU tests) replaces the kernels.
"""

from __future__ import annotations

from megamoe.backends.triton import tma_rows
from tests.megamoe.sm90 import assert_compiles_for_sm90, assert_fits_beside

# the row-gathering GEMMs must keep cp.async loads in flight across their MMAs (a gather waited for
# before every MMA runs a fraction of the speed)
PIPELINED = ("gemm1: row gather + SwiGLU epilogue", "gemm1: plain row gather", "dgrad2: row gather, B [K, N]")


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    report = assert_compiles_for_sm90("tests.megamoe.triton.sm90_compile", pipelined=PIPELINED)
    # the backward's side gathers must fit on an SM beside the persistent programs they run beside
    # (side_gather.py): the dgrads, and the wgrad beside which dW1's next column chunk is gathered
    gemms = [
        report["dgrad2: row gather, B [K, N]"],
        report["dgrad1: A by TMA, B [K, N]"],
        report["wgrad (K-grouped)"],
        report["wgrad (K-grouped), 48 tiles per expert"],
    ]
    assert_fits_beside(report["row gather beside a GEMM"], gemms)
    assert_fits_beside(report["TMA row gather beside a GEMM"], gemms, warps=tma_rows.NUM_WARPS)
