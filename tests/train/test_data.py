"""Real datasets through megatron-core's builder on the prepared demo corpus (no ranks needed): the
model's vocabulary from the tokenizer, a blend, per-split paths, the epoch warning, the sample order."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megamoe.errors import InvalidConfigError
from megamoe.train.config import resolve_config
from megamoe.train.data import build_datasets, model_vocab_size, tokenizer_for
from megamoe.train.validate import plan_run

DEMO = Path(__file__).resolve().parents[2] / "examples/megatron/configs/cpu/moe_tiny-pretrain.yaml"


def _setup(demo_data: Path, tmp_path: Path, *argv: str):
    environ = {"PRIMUS_DATA_DIR": str(demo_data)}
    cfg = resolve_config(DEMO, ["--workspace", str(tmp_path), *argv], environ).config
    return cfg, plan_run(cfg, world_size=2, has_cuda=False)


def test_the_vocabulary_is_the_tokenizers_and_a_smaller_vocab_size_is_an_error(
    demo_data: Path, tmp_path: Path
) -> None:
    cfg, _ = _setup(demo_data, tmp_path)
    tokenizer = tokenizer_for(cfg)
    assert model_vocab_size(cfg, tokenizer) == 2048
    bigger, _ = _setup(demo_data, tmp_path, "--vocab_size", "4096")
    assert model_vocab_size(bigger, tokenizer) == 4096
    smaller, _ = _setup(demo_data, tmp_path, "--vocab_size", "1024")
    with pytest.raises(
        InvalidConfigError, match=r"^vocab_size=1024: smaller than the tokenizer's vocabulary \(2,048 ids"
    ):
        model_vocab_size(smaller, tokenizer)


@pytest.fixture
def one_rank():
    """A 1-rank gloo group: megatron-core's blended datasets ask for the rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_splits_blends_and_per_split_paths_build_with_the_cache_under_the_workspace(
    demo_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, one_rank: None
) -> None:
    prefix = str(demo_data / "pydoc_text_document")
    cfg, plan = _setup(demo_data, tmp_path)
    datasets = build_datasets(cfg, plan, tokenizer_for(cfg))
    assert len(datasets.train) >= 40 * 16 and datasets.valid is not None and datasets.test is not None
    assert list((tmp_path / "data_cache").glob("*-GPTDataset-train-shuffle_index.npy"))
    again = build_datasets(cfg, plan, tokenizer_for(cfg))
    assert (again.train[5]["tokens"] == datasets.train[5]["tokens"]).all(), "same seed, same samples"

    blend, plan = _setup(demo_data, tmp_path, "--data_path", f"0.7 {prefix} 0.3 {prefix}")
    assert len(build_datasets(blend, plan, tokenizer_for(blend)).train) >= 40 * 16

    per_split, plan = _setup(demo_data, tmp_path, "--data_path", "null", "--train_data_path", prefix,
                             "--valid_data_path", prefix, "--train_iters", "400")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="megamoe.train.data"):
        built = build_datasets(per_split, plan, tokenizer_for(per_split))
    assert built.test is None and built.valid is not None
    assert "train split: 1,9" in caplog.text and "Megatron repeats the data" in caplog.text
