"""Training, validation and test data: megatron-core's GPT datasets (real indexed files or mock),
addressed by iteration so a resumed run reads exactly the samples the uninterrupted one would have read.

Sample ``it * gbs + j * (mbs * dp) + dp_rank * mbs + k`` feeds micro-batch ``j``, item ``k`` of
iteration ``it`` on data-parallel rank ``dp_rank``: no iterator state needs checkpointing. Real data
goes through ``BlendedMegatronDatasetBuilder`` (blends, ``split``, per-split paths, the index cache
under ``data_cache_path``), so its shuffling and epoch handling are Megatron's. Validation reads the
same first ``eval_iters`` global batches of its split at every evaluation, so the curve compares
like with like.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megamoe.errors import InvalidConfigError
from megamoe.train import indexed
from megamoe.train.schema import PretrainConfig
from megamoe.train.tokenizer import build_tokenizer, null_tokenizer
from megamoe.train.validate import RunPlan

logger = logging.getLogger(__name__)

MOCK_VOCAB_SIZE = 128
"""The mock data's vocabulary when ``vocab_size`` is null."""


@dataclass(frozen=True, kw_only=True)
class Datasets:
    """One dataset per split; ``valid``/``test`` are None when the split has no data or no eval is asked."""

    train: Any
    valid: Any | None
    test: Any | None


def tokenizer_for(cfg: PretrainConfig) -> Any:
    """The data's tokenizer: the configured one for real data, a null tokenizer for mock data."""
    m = cfg.model
    if cfg.data.mock_data:
        return null_tokenizer(m.vocab_size or MOCK_VOCAB_SIZE)
    return build_tokenizer(m.tokenizer_type, m.tokenizer_model, m.vocab_size)


def model_vocab_size(cfg: PretrainConfig, tokenizer: Any) -> int:
    """The embedding's rows before padding: ``vocab_size`` when set, else the tokenizer's."""
    set_size = cfg.model.vocab_size
    if cfg.data.mock_data or set_size is None:
        return tokenizer.vocab_size
    if set_size < tokenizer.vocab_size:
        raise InvalidConfigError(
            "vocab_size",
            set_size,
            f"smaller than the tokenizer's vocabulary ({tokenizer.vocab_size:,} ids of {cfg.model.tokenizer_model})",
            f"Set vocab_size: null (the tokenizer's, padded to make_vocab_size_divisible_by) or >= {tokenizer.vocab_size}",
        )
    return set_size


def build_datasets(cfg: PretrainConfig, plan: RunPlan, tokenizer: Any) -> Datasets:
    """Enough samples for every iteration of the run, every evaluation and the final test."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    d, t = cfg.data, cfg.training
    eval_samples = t.eval_iters * plan.global_batch_size if t.eval_iters else None
    sizes = [t.train_iters * plan.global_batch_size, eval_samples, eval_samples]
    blend: dict[str, Any] = {}
    if not d.mock_data:
        if d.data_path is not None:
            blend = {"blend": indexed.parse_blend(d.data_path, "data_path").as_megatron(), "split": d.split}
        else:
            blend = {"blend_per_split": [_blend_or_none(d, name) for name in ("train", "valid", "test")]}
    config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=t.seq_length,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        tokenizer=tokenizer,
        path_to_cache=None if d.mock_data else str(plan.data_cache_dir),
        mid_level_dataset_surplus=0.005,
        **blend,
    )
    if not d.mock_data:
        plan.data_cache_dir.mkdir(parents=True, exist_ok=True)
    cls = MockGPTDataset if d.mock_data else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None or len(train) == 0:
        raise InvalidConfigError(
            "split" if d.data_path else "train_data_path",
            d.split if d.data_path else d.train_data_path,
            "gives the training split no samples",
            "Give training a larger share of the split, or more data",
        )
    if not d.mock_data and _is_rank_zero():
        for name, dataset, needed in (
            ("train", train, sizes[0]),
            ("valid", valid, sizes[1]),
            ("test", test, sizes[2]),
        ):
            _log_epochs(name, dataset, needed, t.seq_length)
    if t.eval_iters and not _has_samples(valid) and _is_rank_zero():
        logger.warning("eval_iters=%d but the validation split holds no data: no validation", t.eval_iters)
    return Datasets(
        train=train, valid=valid if _has_samples(valid) else None, test=test if _has_samples(test) else None
    )


def _blend_or_none(d: Any, split: str) -> tuple[list[str], list[float] | None] | None:
    text = getattr(d, f"{split}_data_path")
    return indexed.parse_blend(text, f"{split}_data_path").as_megatron() if text else None


def _is_rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _has_samples(dataset: Any) -> bool:
    return dataset is not None and len(dataset) > 0


def _log_epochs(split: str, dataset: Any, needed: int | None, seq_length: int) -> None:
    """Megatron repeats epochs when a split is smaller than the run needs: say so once."""
    if not needed or dataset is None:
        return
    tokens = sum(_tokens_per_epoch(d) for d in getattr(dataset, "datasets", [dataset]))
    per_epoch = max((tokens - 1) // seq_length, 0)
    if per_epoch and needed > per_epoch:
        logger.warning(
            "%s split: %s samples of %d tokens per epoch, the run reads %s: Megatron repeats the data "
            "(%.1f epochs). Add data for a run that sees every sample once",
            split, f"{per_epoch:,}", seq_length, f"{needed:,}", needed / per_epoch,
        )  # fmt: skip
    else:
        logger.info(
            "%s split: %s samples per epoch, the run reads %s", split, f"{per_epoch:,}", f"{needed:,}"
        )


def _tokens_per_epoch(dataset: Any) -> int:
    return int(dataset.dataset.sequence_lengths[dataset.indices].sum())


def batches(
    dataset: Any, plan: RunPlan, micro_batch_size: int, dp_rank: int, start_iteration: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches for this DP rank from ``start_iteration`` on, in schedule order."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    iteration = start_iteration
    while True:
        for j in range(plan.num_microbatches):
            first = (
                iteration * plan.global_batch_size
                + (j * plan.data_parallel_size + dp_rank) * micro_batch_size
            )
            items = [dataset[(first + k) % len(dataset)] for k in range(micro_batch_size)]
            batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
            yield {k: v.to(device, non_blocking=True) if device else v for k, v in batch.items()}
        iteration += 1
