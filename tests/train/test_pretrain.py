"""Real 2-rank training on CPU through the real entry (torchrun, gloo): the real-text demo with
validation and TensorBoard, EP=2, PP=2, MegaMoE vs megatron's MoELayer, kill after a checkpoint and
resume (mock and real data), and start-up failures before any step.

Each run is a fresh `python -m torch.distributed.run --standalone --nproc_per_node 2 -m megamoe.train`;
per-iteration numbers come from the run's ``training_log.jsonl``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.train import _runs as runs
from tests.train._runs import DEMO, DEMO_PP2, DSV3, MOCK, ROOT, history, kill_tree, train

pytestmark = pytest.mark.slow


def test_real_text_demo_trains_with_validation_loss_going_down(tmp_path: Path, demo_data: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    started = time.monotonic()
    proc = train(
        DEMO,
        tmp_path,
        "--tensorboard_dir",
        str(tmp_path / "tb"),
        env=runs.default_env(PRIMUS_DATA_DIR=str(demo_data)),
    )
    elapsed = time.monotonic() - started
    losses = runs.losses(tmp_path, "moe_tiny-pretrain")
    valid = {it: r["lm_loss"] for it, r in history(tmp_path, "moe_tiny-pretrain", "valid").items()}
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses
    assert sorted(valid) == [10, 20, 30, 40] and valid[40] < valid[10] - 0.3, valid
    assert history(tmp_path, "moe_tiny-pretrain", "test"), "the test split is evaluated once at the end"
    assert "MoE block: MegaMoE" in proc.stderr and "validation loss at iteration 40 | lm loss" in proc.stderr
    assert re.search(
        r"summary: trained iterations 1\.\.40 \|.*\| validation loss [\d.]+ \(ppl [\d.]+\) \| test loss",
        proc.stderr,
    )
    assert not re.search(
        r"train: +\d+%", proc.stderr
    )  # no progress bar off a terminal, a line per log_interval
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss validation")] == [10, 20, 30, 40]
    assert len(events.Scalars("lm loss")) == 40 and events.Scalars("grad-norm")
    assert elapsed < 120, f"the demo took {elapsed:.0f} s on this machine"


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("--pipeline_model_parallel_size", "2", "--expert_model_parallel_size", "1",
                      "--micro_batch_size", "2", "--global_batch_size", "8"), id="pp2-megamoe"),
        pytest.param(("--use_turbo_mega_moe", "false",), id="ep2-megatron-moelayer"),
    ],
)  # fmt: skip
def test_evaluation_on_real_text_with_pp2_and_with_megatron_moelayer(
    tmp_path: Path, demo_data: Path, layout: tuple
) -> None:
    train(DEMO, tmp_path, *layout, "--train_iters", "4", "--eval_interval", "2", "--eval_iters", "1",
          "--disable_last_saving", "true", env=runs.default_env(PRIMUS_DATA_DIR=str(demo_data)))  # fmt: skip
    valid = history(tmp_path, "moe_tiny-pretrain", "valid")
    assert sorted(valid) == [2, 4] and all(math.isfinite(r["lm_loss"]) for r in valid.values())
    assert valid[4]["lm_loss"] < valid[2]["lm_loss"]


def test_pretrain_pp2_1f1b_loss_goes_down(tmp_path: Path) -> None:
    proc = train(
        DEMO_PP2, tmp_path, "--train_iters", "8", "--progress_bar", "false", "--disable_last_saving", "true"
    )
    losses = [r["lm_loss"] for _, r in sorted(history(tmp_path, "moe_tiny-pp2-pretrain").items())]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    assert "PP=2" in proc.stderr


def test_deepseek_v3_tiny_mla_mtp_group_routing_trains_with_megamoe_ep2(tmp_path: Path) -> None:
    """The seed experiment file with the DeepSeek-V3-shaped toy model: MLA (local SDPA core attention),
    one MTP layer, group-limited sigmoid routing, shared expert, forced uniform routing."""
    argv = (
        "--pipeline_model_parallel_size", "1", "--pipeline_model_parallel_layout", "null",
        "--expert_model_parallel_size", "2", "--recompute_granularity", "null", "--recompute_num_layers", "0",
        "--micro_batch_size", "2", "--global_batch_size", "4", "--seq_length", "64", "--train_iters", "6",
        "--lr", "1e-3", "--bf16", "false", "--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True",
        "--moe_router_force_load_balancing_type", "uniform", "--progress_bar", "false",
        "--disable_last_saving", "true",
    )  # fmt: skip
    proc = train(DSV3, tmp_path, *argv, env=runs.default_env(PRIMUS_MODEL="deepseek_v3_tiny"))
    losses = [r["lm_loss"] for _, r in sorted(history(tmp_path, "deepseek_v3-pretrain").items())]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert "EP=2 (8 experts/rank)" in proc.stderr


def test_pretrain_pp2_with_two_virtual_stages_per_rank_loss_goes_down(tmp_path: Path) -> None:
    train(DEMO_PP2, tmp_path, "--pipeline_model_parallel_layout", "Et|t|t|tL", "--train_iters", "6",
          "--progress_bar", "false", "--disable_last_saving", "true")  # fmt: skip
    losses = [r["lm_loss"] for _, r in sorted(history(tmp_path, "moe_tiny-pp2-pretrain").items())]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("precision", ["mxfp8", "fp8"])
def test_megamoe_quantised_experts_train(tmp_path: Path, precision: str) -> None:
    proc = train(MOCK, tmp_path, "--turbo_mega_moe_precision", precision, "--train_iters", "6", "--progress_bar",
                 "false", "--disable_last_saving", "true")  # fmt: skip
    losses = runs.losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < 0.85 * losses[0], losses
    assert f"precision={precision}" in proc.stderr


def test_dense_model_trains_with_tensor_parallelism(tmp_path: Path) -> None:
    proc = train(MOCK, tmp_path, "--num_experts", "null", "--moe_layer_freq", "1", "--tensor_model_parallel_size",
                 "2", "--expert_model_parallel_size", "1", "--global_batch_size", "8", "--train_iters", "6",
                 "--progress_bar", "false", "--disable_last_saving", "true")  # fmt: skip
    losses = runs.losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0], losses
    assert "TP=2" in proc.stderr and "the model has no MoE layers" in proc.stderr


@pytest.mark.parametrize(
    "routing",
    [
        pytest.param((), id="learned-routing"),
        pytest.param(("--moe_router_force_load_balancing", "true", "--moe_router_force_load_balancing_type", "even"),
                     id="forced-even"),
        pytest.param(("--moe_router_force_load_balancing", "true", "--moe_router_force_load_balancing_type",
                      "uniform"), id="forced-uniform"),
    ],
)  # fmt: skip
def test_megamoe_and_megatron_moelayer_give_the_same_first_losses(tmp_path: Path, routing: tuple) -> None:
    """Same seed, same data: the fused layer and megatron's MoELayer train the same model (A/B is fair)."""
    runs = {}
    for switch in ("true", "false"):
        workspace = tmp_path / switch
        train(MOCK, workspace, "--train_iters", "3", "--use_turbo_mega_moe", switch, "--progress_bar", "false",
              "--disable_last_saving", "true", *routing)  # fmt: skip
        runs[switch] = history(workspace, "moe_tiny-mock-pretrain")
    for it in (1, 2, 3):
        mega, megatron = runs["true"][it], runs["false"][it]
        assert mega["lm_loss"] == pytest.approx(megatron["lm_loss"], rel=1e-5), it
        assert mega["aux_loss"] == pytest.approx(megatron["aux_loss"], rel=1e-5), it
        assert mega["grad_norm"] == pytest.approx(megatron["grad_norm"], rel=1e-4), it


def _kill_after_first_checkpoint(
    config: Path, workspace: Path, argv: tuple[str, ...], env: dict[str, str]
) -> int:
    """Start a run and SIGKILL every process of it once a checkpoint is published; its iteration."""
    proc = subprocess.Popen(
        runs.command(config, workspace, argv), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            trackers = list(workspace.glob("*/*/*/checkpoints/latest_checkpointed_iteration.txt"))
            if trackers and trackers[0].read_text().strip():
                kill_tree(proc.pid)
                return int(trackers[0].read_text())
            time.sleep(0.05)
        pytest.fail(f"no checkpoint appeared (exit code {proc.poll()})")
    finally:
        kill_tree(proc.pid)
        proc.wait()


@pytest.mark.parametrize(
    "extra",
    [
        # the distributed optimizer, random router logits (the RNG state restored), real text with evaluation
        pytest.param(("--mock_data", "false", "--eval_interval", "2", "--eval_iters", "1",
                      "--moe_router_force_load_balancing", "true", "--moe_router_force_load_balancing_type", "uniform"),
                     id="megamoe-distributed-optimizer-uniform-routing-real-text-with-evaluation"),
        pytest.param(("--use_turbo_mega_moe", "false", "--use_distributed_optimizer", "false",
                      "--overlap_param_gather", "false"), id="moelayer-plain-optimizer"),
    ],
)  # fmt: skip
def test_killed_run_resumes_from_its_checkpoint_on_the_uninterrupted_curve(
    tmp_path: Path, extra: tuple, demo_data: Path
) -> None:
    """Mock data, or the real text (``--mock_data false`` over the demo config, whose data and
    validation set come from the prepared corpus): the resumed run reads the same samples."""
    real = "--mock_data" in extra
    config, exp = (DEMO, "moe_tiny-pretrain") if real else (MOCK, "moe_tiny-mock-pretrain")
    env = runs.default_env(PRIMUS_DATA_DIR=str(demo_data))
    argv = ("--train_iters", "6", "--save_interval", "3", "--auto_continue_train", "true", "--progress_bar", "false",
            *extra)  # fmt: skip
    train(config, tmp_path / "whole", *argv, env=env)
    killed_at = _kill_after_first_checkpoint(config, tmp_path / "killed", argv, env)
    assert killed_at == 3
    proc = train(config, tmp_path / "killed", *argv, env=env)
    assert "resumed from" in proc.stderr and "iteration 3" in proc.stderr
    for event, keys in (("train", ("lm_loss", "grad_norm", "lr")), ("valid", ("lm_loss",))):
        whole, resumed = history(tmp_path / "whole", exp, event), history(tmp_path / "killed", exp, event)
        for it in (4, 5, 6):
            if event == "valid" and it not in whole:
                continue
            for key in keys:
                assert resumed[it][key] == pytest.approx(whole[it][key], rel=1e-6, abs=1e-9), (event, it, key)
    if real:
        log = next((tmp_path / "killed").glob("*/*/*/training_log.jsonl")).read_text().splitlines()
        starts = [json.loads(line) for line in log if '"run_start"' in line]
        assert [r["start_iteration"] for r in starts] == [0, 3], "each launch is marked in the log"


def test_megamoe_setting_it_cannot_honour_fails_before_any_step(tmp_path: Path) -> None:
    proc = subprocess.run(
        runs.command(MOCK, tmp_path, ("--moe_router_load_balancing_type", "seq_aux_loss")),
        cwd=ROOT, env=runs.default_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "moe_router_load_balancing_type='seq_aux_loss': not supported by MegaMoE" in proc.stderr
    assert not list(tmp_path.glob("**/training_log.jsonl"))
