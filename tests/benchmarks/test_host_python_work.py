"""The host-work benchmark on CPU, where it runs: in its own process, since it replaces every Triton
launch of that process with a no-op."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.host_python_work", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_reports_python_work_per_precision_with_a_profile() -> None:
    res = _run(
        "--tokens", "16", "--calls", "2", "--rounds", "1", "--precision", "bf16,fp8", "--cprofile", "5"
    )
    assert res.returncode == 0, res.stderr
    lines = re.findall(r"^H1024-E8-K2 T=16 (\w+): (\d+) us of Python work per fwd\+bwd$", res.stdout, re.M)
    assert [p for p, _ in lines] == ["bf16", "fp8"] and all(int(us) > 0 for _, us in lines)
    assert res.stdout.count("Ordered by: internal time") == 2


def test_unknown_precision_is_named_before_anything_runs() -> None:
    res = _run("--precision", "bf16,fp4")
    assert res.returncode == 2
    assert "['fp4']: choose from bf16, fp8, mxfp8" in res.stderr
