"""primus-cli container mode with real podman and the base image localhost/megamoe-base:ci."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import BASE_IMAGE
from tests.runner._support import ALLREDUCE, PRIMUS_CLI, free_port, job_env, launch, processes_mentioning

pytestmark = [pytest.mark.container, pytest.mark.timeout(180)]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Launcher config for this box: the base image, no GPU, limits runc may set without CAP_SYS_RESOURCE."""
    (tmp_path / "launcher.yaml").write_text(
        f"container: {{image: '{BASE_IMAGE}', gpu: none, runtime: podman,"
        " ulimits: ['nofile=20000:20000', 'nproc=4096:4096']}\n"
    )
    return tmp_path


def _args(workdir: Path, script: Path, *extra: str) -> list[str]:
    return ["--config", str(workdir / "launcher.yaml"), "container", "--", "--script", str(script), *extra]


def test_container_runs_torchrun_inside_the_image(workdir: Path, container_env: dict[str, str]) -> None:
    job = workdir / "allreduce.py"
    job.write_text(ALLREDUCE)
    env = job_env(container_env, MASTER_PORT=free_port())
    res = launch(_args(workdir, job), cwd=workdir, env=env)
    assert res.returncode == 0, res.stderr
    assert "rank 0 world 2 sum 3.0" in res.stdout and "rank 1 world 2 sum 3.0" in res.stdout


def test_container_secret_is_forwarded_but_never_visible(
    workdir: Path, container_env: dict[str, str]
) -> None:
    secret = f"hf_{secrets.token_hex(12)}"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    job = workdir / "check_secret.py"
    job.write_text(
        "import hashlib, os, sys, time\n"
        "ok = hashlib.sha256(os.environ.get('HF_TOKEN', '').encode()).hexdigest() == sys.argv[1]\n"
        "print(f'HF_TOKEN forwarded: {ok}', flush=True)\n"
        "time.sleep(4)\n"
    )
    env = job_env(container_env, MASTER_PORT=free_port(), HF_TOKEN=secret, GPUS_PER_NODE="1")
    proc = subprocess.Popen([PRIMUS_CLI, *_args(workdir, job, digest)], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    seen: list[str] = []
    while proc.poll() is None:  # look at every process's command line while the job runs
        seen += processes_mentioning(secret)
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "HF_TOKEN forwarded: True" in out
    assert seen == []
    dry = launch(["--dry-run", *_args(workdir, job, digest)], cwd=workdir, env=env)
    assert "-e HF_TOKEN" in dry.stdout
    logs = [p.read_text(errors="replace") for p in (workdir / "logs").rglob("*") if p.is_file()]
    for text in (out, err, dry.stdout, dry.stderr, *logs):
        assert secret not in text


def test_container_sigterm_ends_the_job_with_nonzero_code_and_no_orphans(
    workdir: Path, container_env: dict[str, str]
) -> None:
    token = f"sleeper_{secrets.token_hex(6)}"
    job = workdir / f"{token}.py"
    job.write_text("import time\nprint('READY', flush=True)\ntime.sleep(120)\n")
    job_id = f"sigterm-{token}"
    env = job_env(container_env, MASTER_PORT=free_port(), PRIMUS_JOB_ID=job_id)
    proc = subprocess.Popen([PRIMUS_CLI, *_args(workdir, job)], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "READY" not in (proc.stdout.readline() or "READY"):
        pass
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=45)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert rc != 0
    time.sleep(1)
    assert processes_mentioning(token) == []
    left = subprocess.run(
        ["podman", "ps", "-aq", "--filter", f"label=io.megamoe.primus-cli.job={job_id}"],
        env=container_env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert left.stdout.strip() == ""


def test_container_clean_removes_only_our_labelled_containers(
    workdir: Path, container_env: dict[str, str]
) -> None:
    tag = secrets.token_hex(4)
    create = ["podman", "create", "--name"]
    ours = subprocess.run([*create, f"ours-{tag}", "--label", "io.megamoe.primus-cli=1", BASE_IMAGE, "true"],
                          env=container_env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    theirs = subprocess.run([*create, f"theirs-{tag}", BASE_IMAGE, "true"],
                            env=container_env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    try:
        job = workdir / "noop.py"
        job.write_text("pass\n")
        env = job_env(container_env, MASTER_PORT=free_port(), GPUS_PER_NODE="1")
        args = [
            "--config",
            str(workdir / "launcher.yaml"),
            "container",
            "--clean",
            "--",
            "--script",
            str(job),
        ]
        res = launch(args, cwd=workdir, env=env)
        assert res.returncode == 0, res.stderr
        exists = ["podman", "container", "exists"]
        assert subprocess.run([*exists, ours], env=container_env, check=False).returncode == 1
        assert subprocess.run([*exists, theirs], env=container_env, check=False).returncode == 0
    finally:
        subprocess.run(
            ["podman", "rm", "-f", ours, theirs], env=container_env, capture_output=True, check=False
        )


@pytest.mark.slurm
def test_slurm_srun_container_torchrun_across_two_nodes(
    workdir: Path, container_env: dict[str, str], slurm_env: dict[str, str]
) -> None:
    job = workdir / "allreduce.py"
    job.write_text(ALLREDUCE)
    env = job_env({**container_env, **slurm_env})
    args = ["--config", str(workdir / "launcher.yaml"), "slurm", "srun", "-N", "2", "--", "container", "--",
            "--script", str(job)]  # fmt: skip
    res = launch(args, cwd=workdir, env=env)
    assert res.returncode == 0, res.stderr
    assert "rank 0 world 4 sum 10.0" in res.stdout and "rank 3 world 4 sum 10.0" in res.stdout
