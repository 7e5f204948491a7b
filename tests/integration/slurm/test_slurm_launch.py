"""primus-cli on a real Slurm cluster (slurmctld + 2 slurmd on localhost, see tests/integration/infra)."""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.runner._support import ALLREDUCE, PRIMUS_CLI, job_env, launch, processes_mentioning

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce.py"
    path.write_text(ALLREDUCE)
    return path


def _wait_for_job(job_id: str, env: dict[str, str], timeout: float = 120) -> str:
    """Poll (not `sbatch --wait`, whose back-off adds up to 30 s) until the job leaves the queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(
            ["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True
        ).stdout.strip():
            break
        time.sleep(0.5)
    show = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return re.search(r"JobState=(\S+)", show).group(1)


def test_srun_two_nodes_two_processes_gloo_allreduce(
    tmp_path: Path, job: Path, slurm_env: dict[str, str]
) -> None:
    res = launch(
        ["slurm", "srun", "-N", "2", "--", "direct", "--", "--script", str(job)],
        cwd=tmp_path,
        env=job_env(slurm_env),
    )
    assert res.returncode == 0, res.stderr
    # console: first and last global rank only; every rank in its node's log file
    assert "rank 0 world 4 sum 10.0" in res.stdout and "rank 3 world 4 sum 10.0" in res.stdout
    assert "rank 1 " not in res.stdout and "rank 2 " not in res.stdout
    logs = sorted((tmp_path / "logs").glob("*-node*.log"))
    assert [p.name.split("-node")[1] for p in logs] == ["0.log", "1.log"]
    assert "rank 1 world 4" in logs[0].read_text() and "rank 2 world 4" in logs[1].read_text()


def test_srun_exit_code_is_the_failing_nodes(tmp_path: Path, slurm_env: dict[str, str]) -> None:
    script = tmp_path / "fail_on_node1.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['NODE_RANK'] == '1' and os.environ['LOCAL_RANK'] == '0':\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    res = launch(
        ["slurm", "srun", "-N", "2", "--", "direct", "--", "--script", str(script)],
        cwd=tmp_path,
        env=job_env(slurm_env),
    )
    assert res.returncode == 3, res.stderr
    assert "node node2 (task 1) failed first with exit code 3" in res.stderr
    assert time.monotonic() - start < 50  # node1 was stopped, not left sleeping


def test_sbatch_rendered_template_runs_to_completion(
    tmp_path: Path, job: Path, slurm_env: dict[str, str]
) -> None:
    marker = tmp_path / "pwned"
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "job.sh"
    sets = {
        "nodes": "2", "entry": "direct", "script": str(job), "primus_cli": PRIMUS_CLI,
        "log_dir": str(logs), "extra": f"$(touch {marker})",
    }  # fmt: skip
    render = launch(
        ["template", "render", "pp8-8node", "-o", str(script), *[f"--set={k}={v}" for k, v in sets.items()]],
        cwd=tmp_path,
        env=job_env(slurm_env),
    )
    assert render.returncode == 0, render.stderr
    sub = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=job_env(slurm_env),
                         capture_output=True, text=True, check=True)  # fmt: skip
    job_id = sub.stdout.strip()
    assert _wait_for_job(job_id, slurm_env) == "COMPLETED"
    out = (logs / f"pp8-8node-{job_id}.out").read_text()
    assert "world 4 sum 10.0" in out
    assert f"args ['$(touch {marker})']" in out  # arrived literally
    assert not marker.exists()


def test_sbatch_follow_streams_the_job_and_returns_its_code(
    tmp_path: Path, job: Path, slurm_env: dict[str, str]
) -> None:
    marker = tmp_path / "pwned"  # the job runs in tmp_path: a shell would create it there
    cfg = tmp_path / "launcher.yaml"
    cfg.write_text("slurm: {job_name: '$(touch pwned)'}\n")
    res = launch(
        [
            "--config",
            str(cfg),
            "slurm",
            "sbatch",
            "-N",
            "2",
            "--follow",
            "--",
            "direct",
            "--",
            "--script",
            str(job),
        ],
        cwd=tmp_path,
        env=job_env(slurm_env),
    )
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.splitlines()[0]
    assert job_id.isdigit()
    assert "rank 0 world 4 sum 10.0" in res.stdout and "rank 3 world 4 sum 10.0" in res.stdout
    assert len(list((tmp_path / "logs" / "slurm").glob(f"*-{job_id}-node*.out"))) == 2
    assert not marker.exists()


def test_srun_sigterm_stops_every_node_without_orphans(tmp_path: Path, slurm_env: dict[str, str]) -> None:
    token = f"sleeper_{secrets.token_hex(6)}"
    job = tmp_path / f"{token}.py"
    job.write_text("import time\nprint('READY', flush=True)\ntime.sleep(120)\n")
    args = ["slurm", "srun", "-N", "2", "--", "direct", "--", "--script", str(job)]
    proc = subprocess.Popen([PRIMUS_CLI, *args], cwd=tmp_path, env=job_env(slurm_env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    assert proc.stdout is not None
    ready = 0
    while ready < 2 and (line := proc.stdout.readline()):  # rank 0 (node1) and rank 3 (node2)
        ready += "READY" in line
    assert ready == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 20
    while processes_mentioning(token) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(token) == []
