"""A preempted sbatch training on the real Slurm cluster saves, requeues itself and resumes.

`scontrol requeue` of a running job cannot be the preemption here: Slurm sends SIGTERM to every
process of the job, srun among them, and srun answers SIGTERM by killing its tasks at once, before
any rank saved. The signal that lets the ranks save is the one the job asked for
(`--signal=B:USR1@<s>`, sent before the time limit); `scancel --batch --signal=USR1` sends it now.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.runner._support import job_env, launch

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[3]
MOCK = ROOT / "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml"
ITERS = 12


def _records(workspace: Path) -> list[dict]:
    path = workspace / "megamoe/demo/moe_tiny-mock-pretrain/training_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _job(job_id: str, env: dict[str, str]) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout


def _wait(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_sbatch_preempted_training_requeues_and_resumes_with_every_step_trained_once(
    tmp_path: Path, slurm_env: dict[str, str]
) -> None:
    workspace = tmp_path / "shared"
    res = launch(
        ["slurm", "sbatch", "-N", "1", "--", "direct", "--gpus-per-node", "2", "--",
         "train", "pretrain", "--config", str(MOCK), "--workspace", str(workspace),
         "--train_iters", str(ITERS), "--save_interval", "100"],
        cwd=tmp_path,
        env=job_env(slurm_env),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.split()[0]
    assert "Requeue=1" in _job(job_id, slurm_env)

    _wait(lambda: any(r.get("iteration", 0) >= 3 for r in _records(workspace)), "iteration 3", 120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_env, check=True)
    _wait(lambda: "Restarts=1" in _job(job_id, slurm_env), "the requeue", 90)
    _wait(lambda: "JobState=COMPLETED" in _job(job_id, slurm_env), "the resumed run to finish", 150)

    starts = [r["start_iteration"] for r in _records(workspace) if r["event"] == "run_start"]
    assert len(starts) == 2 and starts[0] == 0, starts
    saved = starts[1]
    launches: list[list[int]] = []
    for r in _records(workspace):
        if r["event"] == "run_start":
            launches.append([])
        elif r["event"] == "train":
            launches[-1].append(r["iteration"])
    assert 3 <= saved < ITERS
    assert launches == [list(range(1, saved + 1)), list(range(saved + 1, ITERS + 1))], "each step once"

    logs = tmp_path / "logs" / "slurm"
    batch = (logs / f"primus-{job_id}.out").read_text()
    assert f"job {job_id}: SIGUSR1: the ranks save at the next iteration boundary" in batch
    assert "(restart 0)" in batch and "(restart 1)" in batch
    node = (logs / f"primus-{job_id}-node0.out").read_text()
    m = re.search(
        r"preempted \(SIGTERM\): the ranks saved a checkpoint at iteration (\d+) and exited 75", node
    )
    assert m and int(m.group(1)) == saved, node[-3000:]
