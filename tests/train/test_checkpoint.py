"""Checkpoint integrity without a run: the manifest names a truncated or missing file, resume picks
the newest complete checkpoint (or stops with strict_resume), a different layout or model is named
by setting, and a changed LR schedule says which one is used."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamoe.errors import InvalidConfigError
from megamoe.train import checkpoint
from megamoe.train.checkpoint import (
    Facts,
    check_compatible,
    problem_with,
    schedule_differences,
    select_checkpoint,
)


def _facts(**change: object) -> Facts:
    base = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 2,
            "data_parallel_size": 2, "vocab_size": 2048, "model": {"hidden_size": 64, "num_experts": 8}}  # fmt: skip
    return Facts(**{**base, **change})


def _fake_checkpoint(root: Path, iteration: int) -> Path:
    folder = checkpoint.iteration_dir(root, iteration)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    (folder / "common.pt").write_bytes(b"y" * 10)
    checkpoint._write_manifest(folder, _facts())
    (root / checkpoint.TRACKER).write_text(f"{iteration}\n")
    return folder


def test_a_complete_checkpoint_has_no_problem_and_a_truncated_file_is_named(tmp_path: Path) -> None:
    folder = _fake_checkpoint(tmp_path, 2)
    assert problem_with(folder) is None
    (folder / "__0_0.distcp").write_bytes(b"x" * 40)
    assert (
        problem_with(folder) == "__0_0.distcp is 40 bytes but was written with 100 (truncated or overwritten)"
    )
    (folder / "common.pt").unlink()
    assert (
        problem_with(folder) == "__0_0.distcp is 40 bytes but was written with 100 (truncated or overwritten)"
    )
    assert json.loads((folder / checkpoint.MANIFEST).read_text())["facts"]["vocab_size"] == 2048


def test_resume_falls_back_to_the_newest_complete_checkpoint_or_stops_when_strict(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    (newest / "common.pt").unlink()
    iteration, warnings = select_checkpoint(tmp_path, strict=False)
    assert iteration == 2
    assert warnings == [f"checkpoint {newest} is incomplete (common.pt is missing); trying the one before it"]
    with pytest.raises(InvalidConfigError, match=r"^load='.*iter_0000004': the newest checkpoint is incomplete: "
                                                 r"common.pt is missing. Drop --strict_resume"):  # fmt: skip
        select_checkpoint(tmp_path, strict=True)


def test_no_complete_checkpoint_at_all_says_how_to_start_afresh(tmp_path: Path) -> None:
    folder = _fake_checkpoint(tmp_path, 3)
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(InvalidConfigError, match=r"no complete checkpoint.*--overwrite_checkpoints true"):
        select_checkpoint(tmp_path, strict=False)


def test_an_empty_folder_has_nothing_to_resume(tmp_path: Path) -> None:
    assert select_checkpoint(tmp_path, strict=False) == (None, [])


@pytest.mark.parametrize(
    ("current", "with_optimizer", "match"),
    [
        (_facts(model={"hidden_size": 128, "num_experts": 8}), False,
         r"^hidden_size=128: the checkpoint in .* was written with hidden_size=64: a different model"),
        (_facts(vocab_size=4096), False, r"^vocab_size=4096: the checkpoint in .* has a vocabulary of 2048"),
        (_facts(expert_model_parallel_size=1), True,
         r"^expert_model_parallel_size=1: .*written with expert_model_parallel_size=2.*--no_load_optim true"),
    ],
)  # fmt: skip
def test_a_different_model_or_layout_is_named(current: Facts, with_optimizer: bool, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        check_compatible(_facts(), current, Path("/ckpt/iter_0000004"), with_optimizer=with_optimizer)


def test_a_new_layout_without_the_optimizer_state_is_allowed() -> None:
    check_compatible(_facts(), _facts(expert_model_parallel_size=1), Path("/c"), with_optimizer=False)


def test_schedule_differences_name_each_value() -> None:
    scheduler = SimpleNamespace(max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=32, lr_decay_steps=640,
                                lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=640)  # fmt: skip
    saved = {**vars(scheduler), "lr_decay_steps": 320, "wd_incr_steps": 320}
    assert schedule_differences(scheduler, saved) == [
        "lr_decay_iters or train_iters (in samples): config 640, checkpoint 320",
        "train_iters for the weight-decay schedule (in samples): config 640, checkpoint 320",
    ]


@pytest.mark.parametrize(("override", "use_checkpoint"), [(False, True), (True, False)])
def test_override_opt_param_scheduler_wins_over_the_default_checkpoint_schedule(
    override: bool, use_checkpoint: bool
) -> None:
    """megatron-core asserts when both switches are on; ``--override_opt_param_scheduler true`` alone must work."""
    import torch

    from megamoe.train.convert import build_config
    from megamoe.train.loop import _scheduler

    cfg = build_config({}, {"override_opt_param_scheduler": override, "train_iters": 10})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = _scheduler(cfg, SimpleNamespace(global_batch_size=4), optimizer)
    assert (scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler) == (
        override,
        use_checkpoint,
    )
