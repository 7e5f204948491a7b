"""Where every routed row goes, computed on the device from the exchanged counts (no host sync).

Legend: W EP ranks, E experts, G = E / W local experts, ``me`` this rank, C ``[W, E]`` the counts
(``C[s, e]`` rows that rank s routes to expert e), P pool rows, X tile-table capacity.

Each destination's pool is expert-major, and inside an expert source-rank-major, and inside a
source in the source's send order (slots sorted by expert, stable)::

    pool row of (source s, expert e = d*G + g, j-th row)  =  start_d[g] + sum_{s' < s} C[s', e] + j
    start_d[g] = sum_{g' < g} sum_s C[s, d*G + g']

so every rank derives every address from C alone: the source where to push its rows
(``send_dest_row_E``), the destination its per-expert offsets and GEMM tile table, and for each pool
row the source rank and the source's send position, which is where the expert output goes back.
The order is deterministic, like :class:`~megamoe.backends.exchange.TokenExchange`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class SymmLayout:
    """Device tables of one forward, kept by the plan for its backward."""

    send_dest_row_E: Tensor
    """pool row on the owner of expert e where this rank's first row for e lands."""
    expert_start_G1: Tensor
    """pool row offsets of this rank's experts; ``[G]`` = rows received (clamped to P)."""
    tiles_X3: Tensor
    num_tiles_1: Tensor
    row_src_R: Tensor
    """source rank of each pool row."""
    row_pos_R: Tensor
    """the source's send position of each pool row (its combine slot there)."""
    received_rows_1: Tensor
    """rows routed to this rank (unclamped: more than P means the pool overflowed)."""
    seg_start_GW: Tensor
    """pool row of the first row of each (local expert, source) segment (pull mode reads these three)."""
    seg_len_GW: Tensor
    seg_pos_GW: Tensor
    """the source's send position of each segment's first row."""


def build_layout(
    counts_WE: Tensor, *, rank: int, num_local_experts: int, pool_rows: int, block_m: int
) -> SymmLayout:
    """Turn the counts into this rank's send targets, receive offsets, tile table and row origins."""
    W, E = counts_WE.shape
    G, P = num_local_experts, pool_rows
    C = counts_WE.long()
    device = C.device
    # source side: where my rows of expert e = d*G + g start on rank d
    total_DG = C.sum(0).view(W, G)
    start_DG = total_DG.cumsum(1) - total_DG
    send_dest_row_E = start_DG.reshape(E) + C[:rank].sum(0)
    # receive side
    mine_WG = C[:, rank * G : (rank + 1) * G]
    total_G = mine_WG.sum(0)
    received = total_G.sum().reshape(1)
    end_G = total_G.cumsum(0).clamp(max=P)
    expert_start_G1 = torch.cat([end_G.new_zeros(1), end_G])
    # segments (g, s) in pool order and the send position of their first row on the source
    seg_len_GW = mine_WG.t()
    seg_start_GW = expert_start_G1[:-1, None] + seg_len_GW.cumsum(1) - seg_len_GW
    send_base_GW = (C.cumsum(1) - C)[:, rank * G : (rank + 1) * G].t()
    rows = torch.arange(P, device=device)
    seg = (torch.searchsorted(seg_start_GW.reshape(-1), rows, right=True) - 1).clamp(min=0)
    row_src_R = seg % W
    row_pos_R = send_base_GW.reshape(-1)[seg] + rows - seg_start_GW.reshape(-1)[seg]
    tiles_X3, num_tiles_1 = _tile_table(expert_start_G1, max_tiles=-(-P // block_m) + G, block_m=block_m)
    i32 = torch.int32
    return SymmLayout(
        send_dest_row_E=send_dest_row_E.to(i32),
        expert_start_G1=expert_start_G1.to(i32),
        tiles_X3=tiles_X3,
        num_tiles_1=num_tiles_1,
        row_src_R=row_src_R.to(i32),
        row_pos_R=row_pos_R.to(i32),
        received_rows_1=received.to(i32),
        seg_start_GW=seg_start_GW.reshape(-1).to(i32),
        seg_len_GW=seg_len_GW.reshape(-1).to(i32),
        seg_pos_GW=send_base_GW.reshape(-1).to(i32),
    )


def _tile_table(expert_start_G1: Tensor, *, max_tiles: int, block_m: int) -> tuple[Tensor, Tensor]:
    """``(expert, first row, segment end)`` of each BLOCK_M-row tile (``-1`` past the used tiles)."""
    G = expert_start_G1.numel() - 1
    rows_G = expert_start_G1[1:] - expert_start_G1[:-1]
    tiles_G = (rows_G + block_m - 1) // block_m
    tile_end_G = tiles_G.cumsum(0)
    tile = torch.arange(max_tiles, device=expert_start_G1.device)
    expert = torch.searchsorted(tile_end_G, tile, right=True)
    used = expert < G
    e = expert.clamp(max=G - 1)
    first_tile = tile_end_G[e] - tiles_G[e]
    row0 = expert_start_G1[e] + (tile - first_tile) * block_m
    row_end = expert_start_G1[e + 1]
    zero = torch.zeros_like(row0)
    table = torch.stack(
        [torch.where(used, expert, -1), torch.where(used, row0, zero), torch.where(used, row_end, zero)], 1
    )
    return table.to(torch.int32).contiguous(), tile_end_G[-1:].to(torch.int32)
