"""Every launch shape of the fused EP kernel compiles for Hopper (sm_90a), on the CPU.

The GPU compiler can refuse what the CPU interpreter runs: a flattened tile loop that holds a nested
loop or a branch crashed Triton 3.6's loop fusion on the H200 (an earlier tree). Triton compiles for
a ``GPUTarget`` without a GPU and ships ``ptxas``, so this test catches such failures, and register
spills, in CI. It runs in a fresh process because ``TRITON_INTERPRET=1`` (set for the other CPU
tests) replaces the kernels with interpreted ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).with_name("sm90_compile.py")
_SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(_SCRIPT)], capture_output=True, text=True, env=env, timeout=600, check=True
    )
    report = json.loads(out.stdout)
    assert report, "no launch was compiled"
    for launch, result in report.items():
        assert result["compiled"], f"{launch}: {result.get('error')}"
        assert result["spill_bytes"] == 0, f"{launch} spills: {result}"
        assert result["shared"] <= _SMEM_LIMIT, f"{launch} needs too much shared memory: {result}"
