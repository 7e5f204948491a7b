"""Mock GPT data (megatron-core ``MockGPTDataset``), addressed by iteration so a resumed run reads
exactly the samples the uninterrupted one would have read.

Sample ``it * gbs + j * (mbs * dp) + dp_rank * mbs + k`` feeds micro-batch ``j``, item ``k`` of
iteration ``it`` on data-parallel rank ``dp_rank``: no iterator state needs checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megamoe.train.schema import PretrainConfig
from megamoe.train.validate import RunPlan


def null_tokenizer(vocab_size: int) -> Any:
    """megatron-core's null tokenizer; its metadata key changed from ``null`` (0.16) to ``null-text``."""
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=vocab_size
        )
    except (AssertionError, ValueError, KeyError):
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size)


def mock_dataset(cfg: PretrainConfig, plan: RunPlan, tokenizer: Any) -> Any:
    """Enough mock samples for every iteration of the run."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    d = cfg.data
    ds_config = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.training.seq_length,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
    )
    samples = cfg.training.train_iters * plan.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [samples, None, None], lambda: True, ds_config
    ).build()
    return train


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
