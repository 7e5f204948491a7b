"""The one-GPU bf16 Triton kernels compile for Hopper (sm_90a) at the launches the CUDA path makes, on the CPU.

The CPU tests run these kernels in the interpreter, which accepts what the GPU compiler can refuse (a
branch or nested loop in a flattened persistent loop, a layout conversion that needs more shared memory
than a block has) and says nothing about registers. Triton compiles for a ``GPUTarget`` without a GPU
and ships ``ptxas``, so this test compiles every distinct launch (``sm90_compile.py``: the four
grouped-GEMM forms, wgrad, SwiGLU, combine, padding, routing) and checks spills and shared memory. It
runs in a fresh process because ``TRITON_INTERPRET=1`` (set for the other CPU tests) replaces the kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
_SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
# ptxas's spill bytes today: the tile-table kernel is one program holding [CHUNK, BINS] int32 tiles
# (32K elements at 256 experts) once per step; a bound, so that growth is still caught
KNOWN_SPILLS = {"routing offsets, BINS=64": 424, "routing offsets, BINS=256": 1844}


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.megamoe.triton.sm90_compile"],
        capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report, "no launch was compiled"
    for launch, result in report.items():
        assert result["compiled"], f"{launch}: {result.get('error')}"
        assert result["spill_bytes"] <= KNOWN_SPILLS.get(launch, 0), f"{launch} spills: {result}"
        assert result["shared"] <= _SMEM_LIMIT, f"{launch} needs too much shared memory: {result}"
