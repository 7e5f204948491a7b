"""The command: which run under torchrun, which run once, and the paths a container must see."""

from __future__ import annotations

import pytest

from runner.command import parse_command

PREPARE = [
    "train", "prepare-data", "--input", "corpus.jsonl,/data/more.jsonl", "--input=/data/b.txt",
    "--output-prefix", "/scratch/data/corpus", "--tokenizer-type", "HuggingFaceTokenizer",
    "--tokenizer-model", "/models/tok", "--json-keys", "text", "--append-eod", "--workers", "2",
]  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "distributed"),
    [
        (["train", "pretrain", "--config", "x.yaml"], True),
        (["--script", "a.py"], True),
        (PREPARE, False),
        (["train", "prepare-data", "--help"], False),
        (["train", "pretrain", "--help"], False),
    ],
    ids=["pretrain", "script", "prepare-data", "help", "pretrain-help"],
)
def test_command_only_pretrain_and_scripts_run_once_per_gpu(tokens: list[str], distributed: bool) -> None:
    assert parse_command(tokens).distributed is distributed


def test_command_files_are_every_input_and_the_tokenizer() -> None:
    assert parse_command(PREPARE).files() == (
        "corpus.jsonl",
        "/data/more.jsonl",
        "/data/b.txt",
        "/models/tok",
    )


def test_command_output_dir_is_the_output_prefix_directory() -> None:
    assert parse_command(PREPARE).output_dirs() == ("/scratch/data",)


@pytest.mark.parametrize(
    "tokens",
    [
        ["train", "pretrain", "--config", "c.yaml", "--tokenizer_model", "/m/tok"],
        ["train", "pretrain", "--config=c.yaml", "--tokenizer-model=/m/tok"],
        ["train", "pretrain", "--exp", "c.yaml", "--tokenizer_model=/m/tok"],
    ],
    ids=["space", "equals", "alias"],
)
def test_command_files_read_every_spelling(tokens: list[str]) -> None:
    assert parse_command(tokens).files() == ("c.yaml", "/m/tok")
