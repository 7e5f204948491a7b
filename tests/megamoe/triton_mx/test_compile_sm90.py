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

import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
_SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
# ptxas's spill bytes today (a bound, so that growth is still caught): the SwiGLU backward keeps
# [32, 128] fp32 tiles of h, da and their products live with the along-R quantisation
KNOWN_SPILLS = {"swiglu backward + quantize along R (dW2 Q)": 40}


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.megamoe.triton_mx.sm90_compile"],
        capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report, "no launch was compiled"
    for launch, result in report.items():
        assert result["compiled"], f"{launch}: {result.get('error')}"
        assert result["spill_bytes"] <= KNOWN_SPILLS.get(launch, 0), f"{launch} spills: {result}"
        assert result["shared"] <= _SMEM_LIMIT, f"{launch} needs too much shared memory: {result}"
