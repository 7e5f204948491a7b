"""What a job that runs for days needs from resume, on 2 real ranks: a preemption signal saves the
step and the resumed curve equals the uninterrupted one; SIGINT stops after the current step; a
truncated newest checkpoint falls back to the one before it (or stops with strict_resume); a new LR
schedule, a changed EP and a finished workspace each say what happens and how to choose otherwise."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.train import _runs as runs
from tests.train._runs import MOCK, ROOT, history, train

pytestmark = pytest.mark.slow
EXP = "moe_tiny-mock-pretrain"


def _signal_ranks_after(
    workspace: Path, iteration: int, sig: int, argv: tuple[str, ...]
) -> tuple[int, str, int]:
    """Start a run, send ``sig`` to its rank processes (as Slurm signals every process of a step) once
    ``iteration`` is logged; torchrun's exit code, its output, and the last iteration logged when the
    signal was sent."""
    log = workspace / "out.txt"
    workspace.mkdir(parents=True)
    with log.open("w") as out:
        proc = subprocess.Popen(runs.command(MOCK, workspace, argv), cwd=ROOT, env=runs.default_env(),
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 150
        try:
            logged = 0
            while time.monotonic() < deadline and proc.poll() is None and logged < iteration:
                logged = max(_logged_iterations(workspace), default=0)
                time.sleep(0.05)
            ranks = psutil.Process(proc.pid).children()
            for rank in ranks:
                rank.send_signal(sig)
            logged = max(_logged_iterations(workspace), default=0)
            code = proc.wait(timeout=120)
            return code, log.read_text(), logged
        finally:
            runs.kill_tree(proc.pid)


def _logged_iterations(workspace: Path) -> list[int]:
    logs = list(workspace.glob("*/*/*/training_log.jsonl"))
    lines = logs[0].read_text().splitlines() if logs else []
    return [json.loads(line)["iteration"] for line in lines if line.endswith("}") and '"iteration"' in line]


def test_sigterm_saves_the_step_and_the_resumed_run_continues_the_uninterrupted_curve(tmp_path: Path) -> None:
    argv = ("--train_iters", "8", "--save_interval", "100", "--auto_continue_train", "true")
    train(MOCK, tmp_path / "whole", *argv)
    code, out, _ = _signal_ranks_after(tmp_path / "preempted", 3, signal.SIGTERM, argv)
    assert code != 0 and "exitcode  : 75" in out, out[-3000:]
    tracker = next((tmp_path / "preempted").glob("*/*/*/checkpoints/latest_checkpointed_iteration.txt"))
    stopped = int(tracker.read_text())
    assert 3 <= stopped < 8 and f"preempted (SIGTERM): saved at iteration {stopped}; run the job again" in out
    proc = train(MOCK, tmp_path / "preempted", *argv)
    assert "resumed from" in proc.stderr
    whole, resumed = history(tmp_path / "whole", EXP), history(tmp_path / "preempted", EXP)
    assert sorted(resumed) == list(range(1, 9)), "no step trained twice or lost"
    for it in range(stopped + 1, 9):
        for key in ("lm_loss", "grad_norm", "lr"):
            assert resumed[it][key] == pytest.approx(whole[it][key], rel=1e-6, abs=1e-9), (it, key)


def test_sigint_stops_after_the_current_step_without_saving(tmp_path: Path) -> None:
    _, out, logged = _signal_ranks_after(tmp_path / "ws", 2, signal.SIGINT, ("--train_iters", "200"))
    assert "exitcode  : 130" in out, out[-3000:]
    stopped = int(re.search(r"interrupted \(SIGINT\) after iteration (\d+)", out).group(1))
    # The step running when the signal came finishes (a rank may still be one step behind), no more.
    assert logged <= stopped <= logged + 2, (logged, stopped)
    assert max(_logged_iterations(tmp_path / "ws")) == stopped
    assert not list((tmp_path / "ws").glob("*/*/*/checkpoints/iter_*")), "SIGINT saves nothing"


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before_with_a_warning(tmp_path: Path) -> None:
    base = ("--save_interval", "2", "--auto_continue_train", "true")
    train(MOCK, tmp_path, "--train_iters", "4", *base)
    checkpoints = next(tmp_path.glob("*/*/*/checkpoints"))
    shard = sorted((checkpoints / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])

    strict = subprocess.run(runs.command(MOCK, tmp_path, ("--train_iters", "6", "--strict_resume", "true", *base)),
                            cwd=ROOT, env=runs.default_env(), capture_output=True, text=True, timeout=150)  # fmt: skip
    assert strict.returncode != 0
    assert (
        f"load='{checkpoints / 'iter_0000004'}': the newest checkpoint is incomplete: {shard.name} is 1,000 bytes"
        in strict.stderr
    )
    assert "[rank0]: Traceback" not in strict.stderr and "[rank1]: Traceback" not in strict.stderr

    proc = train(MOCK, tmp_path, "--train_iters", "6", *base)
    assert (
        f"checkpoint {checkpoints / 'iter_0000004'} is incomplete ({shard.name} is 1,000 bytes" in proc.stderr
    )
    assert "resumed from" in proc.stderr and "(iteration 2)" in proc.stderr
    assert (
        "the LR schedule differs from the checkpoint's: lr_decay_iters or train_iters (in samples): config 96, checkpoint 64"
        in proc.stderr
    )
    assert "The checkpoint's is used; pass --override_opt_param_scheduler true" in proc.stderr
    config = (checkpoints / "iter_0000006" / "config.yaml").read_text()
    assert (
        "train_iters: 6" in config
        and json.loads((checkpoints / "iter_0000006/manifest.json").read_text())["files"]
    )

    ep1 = subprocess.run(runs.command(MOCK, tmp_path, ("--train_iters", "8", "--expert_model_parallel_size", "1", *base)),
                         cwd=ROOT, env=runs.default_env(), capture_output=True, text=True, timeout=150)  # fmt: skip
    assert ep1.returncode != 0
    assert (
        "expert_model_parallel_size=1: the checkpoint in" in ep1.stderr
        and "--no_load_optim true" in ep1.stderr
    )
    moved = train(
        MOCK,
        tmp_path,
        "--train_iters",
        "8",
        "--expert_model_parallel_size",
        "1",
        "--no_load_optim",
        "true",
        *base,
    )
    assert "(iteration 6)" in moved.stderr and "trained iterations 7..8" in moved.stderr


def test_a_finished_workspace_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    argv = ("--train_iters", "3", "--auto_continue_train", "false")
    train(MOCK, tmp_path, *argv)
    launcher = (
        Path(sys.executable).parent / "primus-cli"
    )  # its preflight stops the job before any rank starts
    again = subprocess.run(
        [str(launcher), "direct", "--", "train", "pretrain", "--config", str(MOCK), "--workspace", str(tmp_path), *argv],
        cwd=ROOT, env=runs.default_env(GPUS_PER_NODE="2"), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert (
        "already holds checkpoints (up to iteration 3) that this run, starting at iteration 0, would overwrite"
        in again.stderr
    )
    proc = train(MOCK, tmp_path, *argv, "--overwrite_checkpoints", "true")
    assert (
        "overwrite_checkpoints: removing the checkpoints in" in proc.stderr
        and "trained iterations 1..3" in proc.stderr
    )
