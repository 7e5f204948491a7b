"""Golden files for plan.to_dict() and the dry-run text: any change to a launch line shows up in review.

Regenerate after an intended change with UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.runner._support import plan

GOLDEN = Path(__file__).parent / "golden"
SEED = [
    "train", "pretrain", "--config", "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml",
    "--num_layers", "4", "--expert_model_parallel_size", "8",
    "--moe_router_force_load_balancing_type", "uniform", "--enable_primus_turbo", "True",
    "--use_turbo_mega_moe", "True", "--mock_data", "True",
]  # fmt: skip
PREPARE_DATA = [
    "train", "prepare-data", "--input", "corpus.jsonl", "--output-prefix", "data/corpus",
    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tok/", "--json-keys", "text",
    "--append-eod", "--workers", "2",
]  # fmt: skip
CASES = {
    "direct_train": ("direct", ["--", *SEED]),
    "container_train": ("container", ["--image", "img:1", "--", *SEED]),
    "slurm_srun_container_train": ("slurm", ["srun", "-N", "8", "--", "container", "--", *SEED]),
    "slurm_srun_direct_script": (
        "slurm",
        ["srun", "--nodes=2", "-p", "debug", "--", "direct", "--", "--script", "a.py", "x"],
    ),
    "slurm_sbatch_train": ("slurm", ["sbatch", "--nodes", "2", "--", "direct", "--", *SEED]),
    "direct_prepare_data": ("direct", ["--", *PREPARE_DATA]),
    "slurm_srun_container_prepare_data": (
        "slurm",
        ["srun", "-p", "cpu", "--", "container", "--", *PREPARE_DATA],
    ),
}


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 once"
    assert text == path.read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_to_dict_matches_golden(case: str) -> None:
    mode, tokens = CASES[case]
    _check(f"{case}.json", json.dumps(plan(mode, tokens).to_dict(), indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_dry_run_text_matches_golden(case: str) -> None:
    mode, tokens = CASES[case]
    _check(f"{case}.txt", str(plan(mode, tokens)) + "\n")


def test_train_pretrain_runs_as_megamoe_train_module_under_torchrun() -> None:
    argv = plan("direct", ["--", "train", "pretrain", "--config", "X", "--num_layers", "4"]).steps[-1].argv
    assert argv[1:3] == ("-m", "torch.distributed.run")
    assert argv[-7:] == ("-m", "megamoe.train", "pretrain", "--config", "X", "--num_layers", "4")
