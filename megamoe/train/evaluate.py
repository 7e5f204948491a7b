"""Validation and test loss: the training schedule run forward only, same parallel layout, no grad."""

from __future__ import annotations

import time
from typing import Any

import torch

from megamoe.train import data, metrics
from megamoe.train.forward import forward_step
from megamoe.train.schema import PretrainConfig
from megamoe.train.sinks import EvalStats
from megamoe.train.validate import RunPlan


def evaluate(
    cfg: PretrainConfig, plan: RunPlan, chunks: list[Any], dataset: Any, *, split: str, iteration: int
) -> EvalStats:
    """Mean LM loss over the split's first ``eval_iters`` global batches (every rank calls it)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = cfg.training
    started = time.perf_counter()
    dp_rank = parallel_state.get_data_parallel_rank()
    iterators = [data.batches(dataset, plan, t.micro_batch_size, dp_rank, 0) for _ in chunks]
    forward_backward = get_forward_backward_func()
    for chunk in chunks:
        chunk.eval()
    losses: list[dict[str, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _ in range(t.eval_iters):
                losses += forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=iterators,
                    model=chunks,
                    num_microbatches=plan.num_microbatches,
                    seq_length=t.seq_length,
                    micro_batch_size=t.micro_batch_size,
                    decoder_seq_length=t.seq_length,
                    forward_only=True,
                )
    finally:
        for chunk in chunks:
            chunk.train()
    lm_loss = metrics.gather_loss(losses)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return EvalStats(split=split, iteration=iteration, lm_loss=lm_loss, seconds=time.perf_counter() - started)
