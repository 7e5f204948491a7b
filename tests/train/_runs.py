"""Running the trainer for real in tests: 2 ranks under torchrun (gloo), its training_log.jsonl read back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples/megatron/configs/cpu/moe_tiny-pretrain.yaml"
MOCK = ROOT / "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml"
DEMO_PP2 = ROOT / "examples/megatron/configs/cpu/moe_tiny-pp2-pretrain.yaml"
DSV3 = ROOT / "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml"


def command(config: Path, workspace: Path, argv: tuple[str, ...]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "megamoe.train", "pretrain", "--config", str(config), "--workspace", str(workspace), *argv,
    ]  # fmt: skip


def default_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def train(
    config: Path, workspace: Path, *argv: str, timeout: float = 150, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the trainer on 2 ranks; fail the test with its output if it fails."""
    proc = subprocess.run(
        command(config, workspace, argv), cwd=ROOT, env=env or default_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def history(workspace: Path, exp_name: str, event: str = "train") -> dict[int, dict]:
    """iteration -> the last ``event`` record written for it (a resumed run rewrites the ones after its
    checkpoint)."""
    path = next(workspace.glob(f"*/*/{exp_name}/training_log.jsonl"))
    records = map(json.loads, path.read_text().splitlines())
    return {r["iteration"]: r for r in records if r["event"] == event}


def losses(workspace: Path, exp_name: str = "moe_tiny-mock-pretrain") -> list[float]:
    return [r["lm_loss"] for _, r in sorted(history(workspace, exp_name).items())]


def kill_tree(pid: int) -> None:
    """SIGKILL torchrun and the rank processes it started (they run in sessions of their own)."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(family, timeout=30)
