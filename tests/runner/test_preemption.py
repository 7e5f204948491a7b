"""Preemption under `primus-cli direct`: SIGTERM/SIGUSR1 make the ranks save and exit 75, SIGINT 130.

Real torchrun with 2 CPU processes: first a stand-in trainer that reports the signal it got (fast),
then the real trainer, stopped by SIGUSR1 and run again until it resumes and finishes (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.runner._support import PRIMUS_CLI, job_env, processes_mentioning

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
MOCK = "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml"
STAND_IN = """\
import os, signal, sys, time
got = []
for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
    signal.signal(getattr(signal, name), lambda s, f: got.append(signal.Signals(s).name))
print("READY", flush=True)
stop_at = int(sys.argv[1]) if len(sys.argv) > 1 else 0
for iteration in range(1, 600):
    time.sleep(0.1)
    if got or iteration == stop_at:
        print(f"rank {os.environ['RANK']} got {got}", flush=True)
        if got[:1] == ["SIGINT"]:
            sys.exit(130)
        why = f"preempted ({got[0]})" if got else "exit_duration_in_mins reached"
        print(f"{why}: saved at iteration {iteration}; run the job again to resume", flush=True)
        sys.exit(75)
"""


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    job = tmp_path / "stand_in.py"
    job.write_text(STAND_IN)
    return subprocess.Popen(
        [PRIMUS_CLI, "direct", "--", "--script", str(job), *args],
        cwd=tmp_path,
        env=job_env(dict(os.environ)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _signal_when_ready(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    assert proc.stdout is not None
    while "READY" not in (proc.stdout.readline() or "READY"):
        pass
    proc.send_signal(sig)
    return proc.communicate(timeout=90)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_preemption_signal_reaches_the_ranks_as_sigterm_through_torchrun_and_exits_75(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _start(tmp_path)
    out, err = _signal_when_ready(proc, sig)
    assert proc.returncode == 75, err
    assert "rank 0 got ['SIGTERM']" in out and "rank 1 got ['SIGTERM']" in out  # never SIGUSR1
    [log] = (tmp_path / "logs").glob("*-node0.log")
    assert "Received 15 death signal" in log.read_text()  # torchrun lived to forward it
    [line] = [line for line in err.splitlines() if "exited 75" in line]
    assert f"preempted ({sig.name}): the ranks saved a checkpoint at iteration " in line
    assert line.endswith(f"run the same command again to resume from it (node log: {log})")
    assert processes_mentioning(str(tmp_path / "stand_in.py")) == []


def test_preemption_sigint_stops_the_ranks_and_exits_130(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    out, err = _signal_when_ready(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert "rank 0 got ['SIGINT']" in out
    assert "stopped by SIGINT (node log: " in err


def test_preemption_ranks_that_stop_on_their_own_with_75_exit_75(tmp_path: Path) -> None:
    """exit_duration_in_mins: the ranks save and exit 75 unasked; torchrun's summary says 75."""
    proc = _start(tmp_path, "3")
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 75, err
    assert "exit_duration_in_mins reached: the ranks saved a checkpoint at iteration 3 and exited 75" in err
    assert "failed first" not in err


# --------------------------------------------------------------------------- the real trainer


def _records(workspace: Path) -> list[dict]:
    path = workspace / "megamoe/demo/moe_tiny-mock-pretrain/training_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train(workspace: Path, *, stop_after: int | None) -> subprocess.CompletedProcess:
    """`primus-cli direct -- train pretrain ...` on 2 ranks; SIGUSR1 once iteration `stop_after` is logged."""
    argv = [PRIMUS_CLI, "direct", "--", "train", "pretrain", "--config", MOCK, "--workspace", str(workspace),
            "--train_iters", "8"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=job_env(dict(os.environ)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while stop_after and proc.poll() is None and time.monotonic() < deadline:
        if any(r["event"] == "train" and r["iteration"] >= stop_after for r in _records(workspace)):
            proc.send_signal(signal.SIGUSR1)
            break
        time.sleep(0.1)
    out, err = proc.communicate(timeout=150)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preemption_real_training_saves_exits_75_and_the_rerun_resumes_without_repeating_a_step(
    tmp_path: Path,
) -> None:
    first = _train(tmp_path, stop_after=3)
    assert first.returncode == 75, first.stderr[-3000:]
    saved = int((tmp_path / "megamoe/demo/moe_tiny-mock-pretrain/checkpoints/latest_checkpointed_iteration.txt")
                .read_text())  # fmt: skip
    assert 3 <= saved < 8
    assert (
        f"preempted (SIGUSR1): the ranks saved a checkpoint at iteration {saved} and exited 75"
        in first.stderr
    )

    second = _train(tmp_path, stop_after=None)
    assert second.returncode == 0, second.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["start_iteration"] for r in records if r["event"] == "run_start"] == [0, saved]
    launches: list[list[int]] = []
    for r in records:
        if r["event"] == "run_start":
            launches.append([])
        elif r["event"] == "train":
            launches[-1].append(r["iteration"])
    assert launches == [list(range(1, saved + 1)), list(range(saved + 1, 9))], "each step trained once"
