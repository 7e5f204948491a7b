"""Real torchrun under `primus-cli direct`: exit codes and signals (2 CPU processes, gloo)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.runner._support import ALLREDUCE, PRIMUS_CLI, free_port, job_env, launch, processes_mentioning

pytestmark = pytest.mark.timeout(120)


def test_direct_runs_two_ranks_and_logs_one_file_per_node(tmp_path: Path) -> None:
    job = tmp_path / "allreduce.py"
    job.write_text(ALLREDUCE)
    res = launch(
        ["direct", "--", "--script", str(job), "a b"],
        cwd=tmp_path,
        env=job_env({"PATH": "/usr/bin:/bin"}, MASTER_PORT=free_port()),
    )
    assert res.returncode == 0, res.stderr
    assert "rank 0 world 2 sum 3.0 args ['a b']" in res.stdout
    assert "rank 1 world 2" in res.stdout  # one node: rank 1 is the last rank
    [log] = (tmp_path / "logs").glob("*-node0.log")
    assert "rank 1 world 2" in log.read_text()


def test_direct_exit_code_is_the_failing_workers(tmp_path: Path) -> None:
    job = tmp_path / "fail.py"
    job.write_text("import os, sys\nsys.exit(5 if os.environ['LOCAL_RANK'] == '1' else 0)\n")
    res = launch(
        ["direct", "--", "--script", str(job)],
        cwd=tmp_path,
        env=job_env({"PATH": "/usr/bin:/bin"}, MASTER_PORT=free_port()),
    )
    assert res.returncode == 5, res.stderr


def test_direct_sigterm_reaches_every_process_and_exits_nonzero(tmp_path: Path) -> None:
    token = f"sleeper_{secrets.token_hex(6)}"
    job = tmp_path / f"{token}.py"
    job.write_text("import time\nprint('READY', flush=True)\ntime.sleep(120)\n")
    env = job_env({"PATH": "/usr/bin:/bin"}, MASTER_PORT=free_port())
    proc = subprocess.Popen([PRIMUS_CLI, "direct", "--", "--script", str(job)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert proc.stdout is not None
    while "READY" not in (proc.stdout.readline() or "READY"):
        pass
    assert len(processes_mentioning(token)) == 4  # primus-cli, torchrun and its 2 workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert processes_mentioning(token) == []


def test_direct_hook_exports_and_extras_reach_the_training(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "00_env.sh").write_text('echo "env.FROM_HOOK=hooked"\necho "extra.backend_path=/opt/megatron"\n')
    (hooks / "01_skipped.sh").write_text("exit 1\n")
    (tmp_path / "launcher.yaml").write_text(f"hooks: {{dir: {hooks}}}\n")
    job = tmp_path / "show.py"
    job.write_text("import os, sys\nprint('GOT', os.environ['FROM_HOOK'], sys.argv[1:], flush=True)\n")
    env = job_env(
        {"PATH": "/usr/bin:/bin"}, MASTER_PORT=free_port(), GPUS_PER_NODE="1", PRIMUS_SKIP_HOOKS="01_skipped"
    )
    res = launch(
        ["--config", str(tmp_path / "launcher.yaml"), "direct", "--", "--script", str(job), "x"],
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "GOT hooked ['x', '--backend_path', '/opt/megatron']" in res.stdout


@pytest.mark.slow
def test_direct_two_jobs_on_one_node_without_a_port_both_finish(tmp_path: Path) -> None:
    """No MASTER_PORT, no --master-port: each job gets its own free port instead of colliding."""
    job = tmp_path / "allreduce.py"
    job.write_text(ALLREDUCE)
    env = job_env({"PATH": "/usr/bin:/bin"})
    jobs = [
        subprocess.Popen(
            [PRIMUS_CLI, "direct", "--", "--script", str(job), str(i)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, proc in enumerate(jobs):
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err
        assert f"rank 0 world 2 sum 3.0 args ['{i}']" in out


def test_direct_failure_is_reported_in_one_line_with_the_full_output_in_the_node_log(tmp_path: Path) -> None:
    job = tmp_path / "fail.py"
    job.write_text(
        "import os, sys\nif os.environ['LOCAL_RANK'] == '1':\n    raise ValueError('no such shard: x.bin')\n"
    )
    env = job_env({"PATH": "/usr/bin:/bin"})
    del env["OMP_NUM_THREADS"]  # torchrun's banner about it is printed only when it is unset
    res = launch(["direct", "--", "--script", str(job)], cwd=tmp_path, env=env)
    assert res.returncode == 1
    [log] = (tmp_path / "logs").glob("*-node0.log")
    [report] = [line for line in res.stderr.splitlines() if " ERROR " in line]
    assert report.endswith(
        f"rank 1 failed first with exit code 1: ValueError: no such shard: x.bin (full output: {log})"
    )
    for noise in ("ChildFailedError", "OMP_NUM_THREADS", "Root Cause"):
        assert noise not in res.stdout + res.stderr
    text = log.read_text()
    assert "ChildFailedError" in text and "ValueError: no such shard" in text
    assert "OMP_NUM_THREADS" not in text
