"""The forward step megatron-core's schedules call, for training and evaluation alike."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch


def masked_mean_loss(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean per-token LM loss over the tokens the mask keeps (padding and, if asked, EOD excluded)."""
    mask = loss_mask.view(-1).float()
    loss = (output.float().view(-1) * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
    """One micro-batch through one model chunk; the loss function closes over its mask."""
    batch = next(data_iterator)
    output = chunk(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(masked_mean_loss, batch["loss_mask"])
