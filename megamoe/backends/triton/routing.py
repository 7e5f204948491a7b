"""Routing tables on the device: expert-sorted rows, per-expert offsets and the GEMM tile table.

Legend: T tokens, K top-k, G local experts, S = T*K slots, R = S rows (static: dropped slots sort
last and no tile covers them), X tile-table capacity ``ceil(R / BLOCK_M) + G``.

Everything here is a handful of sync-free torch ops on static shapes, so a forward that builds a
plan captures in a CUDA graph and traces under torch.compile:

* ``row_slot_R``: the slot ``t*K + k`` of each expert-sorted row (stable sort by expert id, so the
  order, and every sum over it, is the same on every run);
* ``row_token_R``: its token, the gather index of the fused dispatch;
* ``slot_row_S``: the inverse, ``-1`` for a dropped slot (the combine reads it);
* ``expert_start_G1``: row offsets, ``expert_start[G]`` = valid rows;
* ``tiles_X3``: ``(expert, first row, segment end)`` of each BLOCK_M-row tile, ``num_tiles_1`` used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """Device-side routing of one forward, reused by its backward; holds no activations."""

    num_tokens: int
    topk: int
    num_experts: int
    block_m: int
    row_slot_R: Tensor
    row_token_R: Tensor
    slot_row_S: Tensor
    expert_start_G1: Tensor
    tiles_X3: Tensor
    num_tiles_1: Tensor

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.topk

    @property
    def max_tiles(self) -> int:
        return int(self.tiles_X3.shape[0])

    def row_is_valid_R(self) -> Tensor:
        """Boolean mask of the rows that carry a routed slot (the rest is padding at the end)."""
        rows = torch.arange(self.num_rows, device=self.row_slot_R.device, dtype=torch.int32)
        return rows < self.expert_start_G1[-1]


def build_routing_plan(topk_idx_TK: Tensor, *, num_experts: int, block_m: int) -> RoutingPlan:
    """Sort the (token, k) slots by expert and cut each expert's rows into BLOCK_M tiles, on device."""
    T, K = topk_idx_TK.shape
    G = num_experts
    device = topk_idx_TK.device
    flat_S = topk_idx_TK.reshape(-1)
    valid_S = (flat_S >= 0) & (flat_S < G)
    key_S = torch.where(valid_S, flat_S, G).to(torch.int32)
    order_R = torch.argsort(key_S, stable=True).to(torch.int32)
    counts_G1 = torch.zeros(G + 1, dtype=torch.int32, device=device)
    counts_G1.scatter_add_(0, key_S.long(), torch.ones_like(key_S))
    counts_G = counts_G1[:G]
    expert_start_G1 = torch.zeros(G + 1, dtype=torch.int32, device=device)
    expert_start_G1[1:] = torch.cumsum(counts_G, 0)
    slot_row_S = torch.empty(T * K, dtype=torch.int32, device=device)
    slot_row_S.scatter_(0, order_R.long(), torch.arange(T * K, dtype=torch.int32, device=device))
    slot_row_S = torch.where(valid_S, slot_row_S, -1)

    tiles_G = (counts_G + block_m - 1) // block_m
    tile_end_G = torch.cumsum(tiles_G, 0).to(torch.int32)
    max_tiles = -(-T * K // block_m) + G
    tile_X = torch.arange(max_tiles, dtype=torch.int32, device=device)
    expert_X = torch.searchsorted(tile_end_G, tile_X, right=True).to(torch.int32)
    in_use_X = expert_X < G
    safe_X = expert_X.clamp(max=G - 1).long()
    first_tile_X = tile_end_G[safe_X] - tiles_G[safe_X]
    row_start_X = expert_start_G1[safe_X] + (tile_X - first_tile_X) * block_m
    row_end_X = expert_start_G1[safe_X + 1]
    tiles_X3 = torch.stack(
        [torch.where(in_use_X, expert_X, -1), row_start_X, torch.where(in_use_X, row_end_X, 0)], dim=1
    ).to(torch.int32)
    return RoutingPlan(
        num_tokens=T,
        topk=K,
        num_experts=G,
        block_m=block_m,
        row_slot_R=order_R,
        row_token_R=torch.div(order_R, K, rounding_mode="floor").to(torch.int32),
        slot_row_S=slot_row_S,
        expert_start_G1=expert_start_G1,
        tiles_X3=tiles_X3.contiguous(),
        num_tiles_1=tile_end_G[-1:].contiguous(),
    )
