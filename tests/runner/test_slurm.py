"""slurm mode: the sbatch script asks for the warning signal, saves on it and requeues; `--signal` checks.

The script's preemption logic runs here under bash with stand-ins for srun, scancel and scontrol
(the real cluster runs it in tests/integration/slurm/test_slurm_preemption.py).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.modes import build_plan
from tests.runner._support import host_facts, request

SCRIPT = ["--", "direct", "--", "--script", "a.py"]


def _script(tmp_path: Path, *slurm: str, config: str | None = None) -> str:
    cfg = None
    if config is not None:
        cfg = tmp_path / "launcher.yaml"
        cfg.write_text(config)
    req = request("slurm", ["sbatch", *slurm, *SCRIPT], config_file=cfg, cwd=str(tmp_path))
    step = build_plan(req, host_facts(), dry_run=True)[0].steps[0]
    assert step.script is not None
    return step.script


def _sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_sbatch_script_requeues_and_asks_for_the_warning_signal_to_the_batch_shell(tmp_path: Path) -> None:
    script = _script(tmp_path)
    assert _sbatch_lines(script)[-2:] == ["--requeue", "--signal=B:USR1@120"]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_sbatch_signal_seconds_and_requeue_come_from_the_launcher_config(tmp_path: Path) -> None:
    script = _script(tmp_path, config="slurm: {signal_seconds: 300, requeue: false}\n")
    assert "--signal=B:USR1@300" in _sbatch_lines(script)
    assert "--requeue" not in _sbatch_lines(script) and "scontrol requeue" not in script
    assert not any(
        f.startswith("--signal")
        for f in _sbatch_lines(_script(tmp_path, config="slurm: {signal_seconds: null}\n"))
    )


def test_sbatch_command_line_no_requeue_and_signal_win(tmp_path: Path) -> None:
    script = _script(tmp_path, "--no-requeue", "--signal=B:TERM@600")
    lines = _sbatch_lines(script)
    assert "--no-requeue" in lines and "--requeue" not in lines and "scontrol requeue" not in script
    assert [f for f in lines if f.startswith("--signal")] == ["--signal=B:TERM@600"]


@pytest.mark.parametrize("value", ["USR1@60", "TERM@60", "B:USR2@60", "R:USR1@60", "B:KILL"])
def test_sbatch_signal_that_would_not_save_is_an_error(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"slurm sbatch --signal={value}: the ranks would not save"):
        _script(tmp_path, f"--signal={value}")


@pytest.mark.parametrize("value", ["B:USR1@30", "B:SIGUSR1@30", "RB:10@30", "B:TERM", "B:15@5"])
def test_sbatch_signal_the_batch_script_handles_is_kept(tmp_path: Path, value: str) -> None:
    assert f"--signal={value}" in _sbatch_lines(_script(tmp_path, f"--signal={value}"))


@pytest.mark.parametrize(
    ("value", "ok"), [("TERM@60", True), ("15@60", True), ("USR1@60", False), ("B:TERM@60", False)]
)
def test_srun_signal_must_be_term_to_the_step(value: str, ok: bool) -> None:
    req = request("slurm", ["srun", f"--signal={value}", *SCRIPT])
    if ok:
        assert f"--signal={value}" in build_plan(req, host_facts(), dry_run=True)[0].steps[0].argv
    else:
        with pytest.raises(ConfigError, match=rf"slurm srun --signal={value}: the ranks would not save"):
            build_plan(req, host_facts(), dry_run=True)


# --------------------------------------------------------------------------- the script's logic

STAND_INS = {
    # srun: a step whose ranks save and exit 75 on SIGTERM, else end with STEP_RC after a while
    "srun": 'echo $$ > "$DIR/srun.pid"\nexec python3 -c "import signal, sys, time\n'
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\ntime.sleep(float(sys.argv[1]))\n"
    'sys.exit(int(sys.argv[2]))" "$STEP_S" "$STEP_RC"\n',
    "scancel": 'echo "scancel $*" >> "$DIR/calls"\nkill -TERM "$(cat "$DIR/srun.pid")"\n',
    "scontrol": 'echo "scontrol $*" >> "$DIR/calls"\n',
}


def _run_script(tmp_path: Path, script: str, *, signal_to_send: int | None, step_s: str, step_rc: str) -> int:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "DIR": str(tmp_path), "STEP_S": step_s, "STEP_RC": step_rc,
        "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
    }  # fmt: skip
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env)
    if signal_to_send is not None:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the stand-in's python has its handler
        proc.send_signal(signal_to_send)
    return proc.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_sbatch_script_turns_the_signal_into_sigterm_to_the_step_and_requeues_on_75(
    tmp_path: Path, sig: int
) -> None:
    rc = _run_script(tmp_path, _script(tmp_path), signal_to_send=sig, step_s="20", step_rc="0")
    assert (tmp_path / "calls").read_text().splitlines() == [
        "scancel --signal=TERM 7.0",
        "scontrol requeue 7",
    ]
    assert rc == 75


def test_sbatch_script_without_requeue_ends_with_75(tmp_path: Path) -> None:
    script = _script(tmp_path, "--no-requeue")
    assert _run_script(tmp_path, script, signal_to_send=signal.SIGUSR1, step_s="20", step_rc="0") == 75
    assert (tmp_path / "calls").read_text().splitlines() == ["scancel --signal=TERM 7.0"]


def test_sbatch_script_other_step_codes_end_the_job_with_that_code(tmp_path: Path) -> None:
    assert _run_script(tmp_path, _script(tmp_path), signal_to_send=None, step_s="0.2", step_rc="3") == 3
    assert not (tmp_path / "calls").exists()
