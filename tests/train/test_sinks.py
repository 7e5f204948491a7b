"""The metrics sinks: JSON lines with run markers, TensorBoard scalars read back with tensorboard's own
EventAccumulator, and an offline W&B run (no network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megamoe.train.convert import build_config
from megamoe.train.metrics import StepStats
from megamoe.train.sinks import EvalStats, JsonlSink, TensorBoardSink, WandbSink


def _step(iteration: int, loss: float) -> StepStats:
    return StepStats(iteration=iteration, lm_loss=loss, aux_loss=1.0, lr=1e-3, grad_norm=0.5, seconds=0.1,
                     tokens_per_s=1000.0, tflops_per_gpu=0.01, peak_mem_gib=0.4)  # fmt: skip


def test_jsonl_marks_each_run_and_tells_train_from_evaluation(tmp_path: Path) -> None:
    path = tmp_path / "training_log.jsonl"
    for start in (0, 2):
        sink = JsonlSink(path, {"start_iteration": start, "resumed": start > 0})
        sink.train(_step(start + 1, 2.0))
        sink.evaluation(EvalStats(split="valid", iteration=start + 1, lm_loss=1.5, seconds=0.1))
        sink.close()
    events = [
        (r["event"], r.get("iteration", r.get("start_iteration")))
        for r in map(json.loads, path.read_text().splitlines())
    ]
    assert events == [
        ("run_start", 0),
        ("train", 1),
        ("valid", 1),
        ("run_start", 2),
        ("train", 3),
        ("valid", 3),
    ]


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(str(tmp_path))
    for it, loss in ((1, 3.0), (2, 2.5)):
        sink.train(_step(it, loss))
    sink.evaluation(EvalStats(split="valid", iteration=2, lm_loss=2.0, seconds=0.1))
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "aux loss", "learning-rate", "grad-norm", "tokens-per-second", "throughput-tflops-per-gpu",
            "mem-max-allocated-gib", "lm loss validation", "lm loss validation ppl"} <= tags  # fmt: skip
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 3.0), (2, 2.5)]
    assert events.Scalars("lm loss validation ppl")[0].value == pytest.approx(math.exp(2.0), rel=1e-6)


def test_wandb_writes_an_offline_run(tmp_path: Path) -> None:
    cfg = build_config({"exp_name": "e", "workspace": str(tmp_path)}, {"wandb_project": "p"})
    sink = WandbSink(cfg, resumed=False)
    sink.train(_step(1, 3.0))
    sink.evaluation(EvalStats(split="valid", iteration=1, lm_loss=2.0, seconds=0.1))
    sink.close()
    runs = list((Path(cfg.output_dir) / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
