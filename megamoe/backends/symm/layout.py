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
import triton
import triton.language as tl
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
    counts_WE: Tensor,
    *,
    rank: int,
    num_local_experts: int,
    pool_rows: int,
    block_m: int,
    epoch_1: Tensor | None = None,
) -> SymmLayout:
    """Turn the counts into this rank's send targets, receive offsets, tile table and row origins.

    One kernel launch (the ~50 small torch launches it replaced cost 0.4-0.65 ms of GPU time per
    forward on H200s). ``counts_WE`` is ``[W, E]``, or with ``epoch_1`` the workspace's two banks
    ``[2, W, E]``, read from bank ``epoch % 2`` on the device.
    """
    W, E = counts_WE.shape[-2:]
    G, P = num_local_experts, pool_rows
    device = counts_WE.device
    max_tiles = -(-P // block_m) + G
    i32 = dict(dtype=torch.int32, device=device)
    out = SymmLayout(
        send_dest_row_E=torch.empty(E, **i32),
        expert_start_G1=torch.empty(G + 1, **i32),
        tiles_X3=torch.empty(max_tiles, 3, **i32),
        num_tiles_1=torch.empty(1, **i32),
        row_src_R=torch.empty(P, **i32),
        row_pos_R=torch.empty(P, **i32),
        received_rows_1=torch.empty(1, **i32),
        seg_start_GW=torch.empty(G * W, **i32),
        seg_len_GW=torch.empty(G * W, **i32),
        seg_pos_GW=torch.empty(G * W, **i32),
    )
    interpret = device.type != "cuda"
    block_r = 16 if interpret else 32
    grid = max(1, min(-(-P // block_r), 2 * 132))
    _layout_kernel[(grid,)](
        counts_WE, epoch_1, rank, W, E, G, P, max_tiles,
        out.send_dest_row_E, out.expert_start_G1, out.tiles_X3, out.num_tiles_1, out.row_src_R,
        out.row_pos_R, out.received_rows_1, out.seg_start_GW, out.seg_len_GW, out.seg_pos_GW,
        BANKED=epoch_1 is not None, W_PAD=max(2, triton.next_power_of_2(W)), G_PAD=max(2, triton.next_power_of_2(G)),
        BLOCK_R=block_r, BLOCK_T=block_r, BLOCK_M=block_m, num_warps=1 if interpret else 4,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["rank", "P", "max_tiles"])
def _layout_kernel(
    counts_ptr, epoch_ptr, rank, W, E, G, P, max_tiles,
    send_dest_row_ptr, expert_start_ptr, tiles_ptr, num_tiles_ptr, row_src_ptr, row_pos_ptr,
    received_ptr, seg_start_ptr, seg_len_ptr, seg_pos_ptr,
    BANKED: tl.constexpr, W_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Every program derives the small tables from C (a few thousand counts); program 0 stores them.
    The per-row origins and the tile table are split over the programs: a row's segment and a tile's
    expert are found by comparing against every segment start / tile end (no gather from registers)."""
    pid = tl.program_id(0)
    if BANKED:
        counts_ptr += (tl.load(epoch_ptr) % 2) * W * E
    s = tl.arange(0, W_PAD)
    g = tl.arange(0, G_PAD)
    # C3[s, d, g] = C[s, d * G + g]: rows source s routes to local expert g of rank d
    s3, d3, g3 = s[:, None, None], s[None, :, None], g[None, None, :]
    C3 = tl.load(counts_ptr + s3 * E + d3 * G + g3, mask=(s3 < W) & (d3 < W) & (g3 < G), other=0)
    # source side: my first row of expert (d, g) lands after every row of d's experts before g and
    # after the rows of (d, g) from the ranks before me
    total_DG = tl.sum(C3, axis=0)
    dest_DG = tl.cumsum(total_DG, axis=1) - total_DG + tl.sum(tl.where(s3 < rank, C3, 0), axis=0)
    # receive side, [source, local expert]
    s2, g2 = s[:, None], g[None, :]
    valid = (s2 < W) & (g2 < G)
    mine = tl.load(counts_ptr + s2 * E + rank * G + g2, mask=valid, other=0)
    total_G = tl.sum(mine, axis=0)
    incl_G = tl.cumsum(total_G, axis=0)
    end_G = tl.minimum(incl_G, P)
    start_G = tl.minimum(incl_G - total_G, P)
    seg_start = start_G[None, :] + tl.cumsum(mine, axis=0) - mine
    before_me = tl.sum(tl.sum(tl.where(d3 < rank, C3, 0), axis=2), axis=1)  # C[s, :rank * G].sum()
    seg_pos = before_me[:, None] + tl.cumsum(mine, axis=1) - mine
    tiles_G = tl.where(g < G, (end_G - start_G + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end_G = tl.cumsum(tiles_G, axis=0)
    if pid == 0:
        tl.store(send_dest_row_ptr + s2 * G + g2, dest_DG, mask=valid)
        tl.store(expert_start_ptr + g + 1, end_G, mask=g < G)
        tl.store(expert_start_ptr, 0)
        tl.store(seg_start_ptr + g2 * W + s2, seg_start, mask=valid)
        tl.store(seg_len_ptr + g2 * W + s2, mine, mask=valid)
        tl.store(seg_pos_ptr + g2 * W + s2, seg_pos, mask=valid)
        tl.store(received_ptr, tl.sum(total_G, axis=0))
        tl.store(num_tiles_ptr, tl.sum(tiles_G, axis=0))
    # pool rows: the segment (g, s) of row r is the last one, in pool order (g-major), starting at or
    # before r (row 0's when none does)
    flat = g2 * W + s2
    seg_start3, flat3, valid3 = seg_start[None, :, :], flat[None, :, :], valid[None, :, :]
    shift3 = (seg_pos - seg_start)[None, :, :]
    num_programs = tl.num_programs(0)
    for r0 in range(pid * BLOCK_R, P, num_programs * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r3 = r[:, None, None]
        best = tl.max(tl.max(tl.where(valid3 & (seg_start3 <= r3), flat3, 0), axis=2), axis=1)
        pick = valid3 & (flat3 == best[:, None, None])
        pos = r + tl.sum(tl.sum(tl.where(pick, shift3, 0), axis=2), axis=1)
        tl.store(row_src_ptr + r, best % W, mask=r < P)
        tl.store(row_pos_ptr + r, pos, mask=r < P)
    # tiles: the expert of tile t is the number of experts whose tiles end at or before t
    first_G = tile_end_G - tiles_G
    for t0 in range(pid * BLOCK_T, max_tiles, num_programs * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t2 = t[:, None]
        expert = tl.sum(((tile_end_G[None, :] <= t2) & (g2 < G)).to(tl.int32), axis=1)
        used = expert < G
        pick = g2 == expert[:, None]
        row0 = tl.sum(tl.where(pick, start_G[None, :] + (t2 - first_G[None, :]) * BLOCK_M, 0), axis=1)
        row_end = tl.sum(tl.where(pick, end_G[None, :], 0), axis=1)
        keep = t < max_tiles
        tl.store(tiles_ptr + 3 * t, tl.where(used, expert, -1), mask=keep)
        tl.store(tiles_ptr + 3 * t + 1, tl.where(used, row0, 0), mask=keep)
        tl.store(tiles_ptr + 3 * t + 2, tl.where(used, row_end, 0), mask=keep)
