"""Every benchmark runs as ``python -m benchmarks.<name>`` from the checkout's root, with no
``PYTHONPATH`` and nothing of benchmarks/ installed (the wheel ships megamoe and runner only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
)


def test_benchmark_scripts_found() -> None:
    assert {"bench", "accuracy", "profile_layer", "sweep_tiles"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_runs_as_module_from_the_root_without_pythonpath(name: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "usage" in res.stdout.lower()
