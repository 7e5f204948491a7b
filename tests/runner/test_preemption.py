"""Preemption under `primus-cli direct`: SIGTERM/SIGUSR1 make the ranks save and exit 75, SIGINT 130.

Real torchrun with 2 CPU processes and a stand-in trainer that reports the signal it got. The real
trainer preempted through the launcher, requeued and resumed with every step trained once is
tests/integration/slurm/test_slurm_preemption.py; the trainer's own save and resume on a signal,
tests/train/test_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
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
