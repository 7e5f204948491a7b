"""The shared pieces of the end-to-end training benchmarks: the trainer's training_log.jsonl read back
(the last launch only), the launcher argv and environment."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import train_runs


def _write_log(path: Path, records: list[dict], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_read_training_log_keeps_the_last_launch_and_counts_cut_lines(tmp_path: Path) -> None:
    path = _write_log(
        tmp_path / "training_log.jsonl",
        [
            {"event": "run_start", "start_iteration": 0},
            {"event": "train", "iteration": 1, "lm_loss": 9.0},
            {"event": "valid", "iteration": 1, "lm_loss": 9.5, "ppl": 1.0},
            {"event": "run_start", "start_iteration": 0},
            {"event": "train", "iteration": 1, "lm_loss": 7.0},
            {"event": "train", "iteration": 2, "lm_loss": float("nan")},
            {"event": "valid", "iteration": 2, "lm_loss": 6.5, "ppl": 665.1},
            {"event": "test", "iteration": 2, "lm_loss": 6.4, "ppl": 601.8},
        ],
        tail='{"event": "train", "itera',  # a kill mid-write
    )
    log = train_runs.read_training_log(path)
    assert [r["iteration"] for r in log.train] == [1, 2]
    assert log.train[0]["lm_loss"] == 7.0 and math.isnan(log.train[1]["lm_loss"])
    assert [(r["iteration"], r["lm_loss"]) for r in log.valid] == [(2, 6.5)]
    assert [r["lm_loss"] for r in log.test] == [6.4]
    assert log.unreadable_lines == 1


def test_find_training_log_looks_under_the_experiment_folders(tmp_path: Path) -> None:
    assert train_runs.find_training_log(tmp_path / "missing") is None
    assert train_runs.find_training_log(tmp_path) is None
    path = _write_log(tmp_path / "megamoe" / "demo" / "moe_tiny-pretrain" / "training_log.jsonl", [])
    assert train_runs.find_training_log(tmp_path) == path


def test_runner_argv_and_env(tmp_path: Path) -> None:
    argv = train_runs.runner_argv("py", tmp_path / "logs", ["--config", "c.yaml", "--lr", "1e-4"])
    assert argv == ["py", "-m", "runner", "direct", "--log-dir", str(tmp_path / "logs"), "--",
                    "train", "pretrain", "--config", "c.yaml", "--lr", "1e-4"]  # fmt: skip
    env = train_runs.launch_env({"KEEP": "1"}, "fp8", 1)
    assert (env["KEEP"], env["GPUS_PER_NODE"], env["PRIMUS_JOB_ID"], env["PYTHONUNBUFFERED"]) == (
        "1",
        "1",
        "fp8",
        "1",
    )
    assert int(env["MASTER_PORT"]) > 0
    assert train_runs.launch_env({"MASTER_PORT": "4242"}, "x", 2)["MASTER_PORT"] == "4242"
