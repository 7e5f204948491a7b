"""Where every routed row goes, computed on the device from the exchanged counts (no host sync).

Legend: W EP ranks, E experts, G = E / W local experts, ``me`` this rank, C ``[W, E]`` the counts
(``C[s, e]`` rows that rank s routes to expert e), P pool rows, X tile-table capacity.

Each destination's pool is expert-major; inside an expert, source-rank-major starting from the
destination itself (d, d+1, ..., d-1: rot_d(s) = (s - d) mod W); inside a source, in the source's
send order (slots sorted by expert, stable)::

    pool row of (source s, expert e = d*G + g, j-th row)  =  start_d[g] + sum_{rot_d(s') < rot_d(s)} C[s', e] + j
    start_d[g] = sum_{g' < g} sum_s C[s, d*G + g']

so every rank derives every address from C alone: the source where to push its rows
(``send_dest_row_E``), the destination its per-expert offsets and GEMM tile table, and for each pool
row the source rank and the source's send position, which is where the expert output goes back.

The tile table lists the *local* tiles first (every BLOCK_M-row tile that holds only this rank's own
rows, which lead each expert), expert by expert, then the rest, expert by expert. The fused kernels
read a rank's own rows straight from ``x``, so a local tile waits for no peer: the first 1/W of the
GEMM runs while the peers' rows are still on the wire. The same counts give the same layout on every
rank and every run, so every sum over the pool (the wgrads) has the same bits every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import next_power_of_2
from megamoe.backends.triton.routing import tile_table_rows


@dataclass(frozen=True, slots=True)
class SymmLayout:
    """Device tables of one forward, kept by the plan for its backward."""

    send_dest_row_E: Tensor
    """pool row on the owner of expert e where this rank's first row for e lands."""
    expert_start_G1: Tensor
    """pool row offsets of this rank's experts; ``[G]`` = rows received (clamped to P)."""
    tiles_X3: Tensor
    num_tiles_1: Tensor
    num_local_tiles_1: Tensor
    """the table's first tiles, which hold only this rank's own rows."""
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
    max_tiles = tile_table_rows(P, G, block_m)
    i32 = dict(dtype=torch.int32, device=device)
    out = SymmLayout(
        send_dest_row_E=torch.empty(E, **i32),
        expert_start_G1=torch.empty(G + 1, **i32),
        tiles_X3=torch.empty(max_tiles, 3, **i32),
        num_tiles_1=torch.empty(1, **i32),
        num_local_tiles_1=torch.empty(1, **i32),
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
        out.send_dest_row_E, out.expert_start_G1, out.tiles_X3, out.num_tiles_1, out.num_local_tiles_1, out.row_src_R,
        out.row_pos_R, out.received_rows_1, out.seg_start_GW, out.seg_len_GW, out.seg_pos_GW,
        BANKED=epoch_1 is not None, W_PAD=max(2, next_power_of_2(W)), G_PAD=max(2, next_power_of_2(G)),
        BLOCK_R=block_r, BLOCK_T=block_r, BLOCK_M=block_m, num_warps=1 if interpret else 4,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["rank", "P", "max_tiles"])
def _layout_kernel(
    counts_ptr, epoch_ptr, rank, W, E, G, P, max_tiles,
    send_dest_row_ptr, expert_start_ptr, tiles_ptr, num_tiles_ptr, num_local_tiles_ptr, row_src_ptr, row_pos_ptr,
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
    # after the rows of (d, g) from the ranks before me in d's order (d first)
    total_DG = tl.sum(C3, axis=0)
    before_on_d = ((s3 - d3 + W) % W) < ((rank - d3 + W) % W)
    dest_DG = tl.cumsum(total_DG, axis=1) - total_DG + tl.sum(tl.where(before_on_d, C3, 0), axis=0)
    # receive side, [source, local expert]; rot: a source's place in my pool order (me first)
    s2, g2 = s[:, None], g[None, :]
    valid = (s2 < W) & (g2 < G)
    mine = tl.load(counts_ptr + s2 * E + rank * G + g2, mask=valid, other=0)
    rot = (s - rank + W) % W
    total_G = tl.sum(mine, axis=0)
    incl_G = tl.cumsum(total_G, axis=0)
    end_G = tl.minimum(incl_G, P)
    start_G = tl.minimum(incl_G - total_G, P)
    ahead = rot[None, :, None] < rot[:, None, None]  # [s, s', 1]: s' precedes s in my pool
    seg_start = start_G[None, :] + tl.sum(tl.where(ahead, mine[None, :, :], 0), axis=1)
    before_me = tl.sum(tl.sum(tl.where(d3 < rank, C3, 0), axis=2), axis=1)  # C[s, :rank * G].sum()
    seg_pos = before_me[:, None] + tl.cumsum(mine, axis=1) - mine
    tiles_G = tl.where(g < G, (end_G - start_G + BLOCK_M - 1) // BLOCK_M, 0)
    # local tiles (only my rows, which lead the expert): all of the expert's when its rows end mine
    local_end_G = tl.minimum(start_G + tl.sum(tl.where(s2 == rank, mine, 0), axis=0), end_G)
    local_G = tl.where(local_end_G == end_G, tiles_G, (local_end_G - start_G) // BLOCK_M)
    rest_G = tiles_G - local_G
    if pid == 0:
        tl.store(send_dest_row_ptr + s2 * G + g2, dest_DG, mask=valid)
        tl.store(expert_start_ptr + g + 1, end_G, mask=g < G)
        tl.store(expert_start_ptr, 0)
        tl.store(seg_start_ptr + g2 * W + s2, seg_start, mask=valid)
        tl.store(seg_len_ptr + g2 * W + s2, mine, mask=valid)
        tl.store(seg_pos_ptr + g2 * W + s2, seg_pos, mask=valid)
        tl.store(received_ptr, tl.sum(total_G, axis=0))
        tl.store(num_tiles_ptr, tl.sum(tiles_G, axis=0))
        tl.store(num_local_tiles_ptr, tl.sum(local_G, axis=0))
    # pool rows: the segment (g, s) of row r is the last one, in pool order (g-major, then rot), starting
    # at or before r (row 0's when none does)
    order = g2 * W + rot[:, None]
    seg_start3, order3, valid3 = seg_start[None, :, :], order[None, :, :], valid[None, :, :]
    shift3 = (seg_pos - seg_start)[None, :, :]
    num_programs = tl.num_programs(0)
    for r0 in range(pid * BLOCK_R, P, num_programs * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r3 = r[:, None, None]
        best = tl.max(tl.max(tl.where(valid3 & (seg_start3 <= r3), order3, 0), axis=2), axis=1)
        pick = valid3 & (order3 == best[:, None, None])
        pos = r + tl.sum(tl.sum(tl.where(pick, shift3, 0), axis=2), axis=1)
        tl.store(row_src_ptr + r, (best % W + rank) % W, mask=r < P)
        tl.store(row_pos_ptr + r, pos, mask=r < P)
    # tiles: the local ones, then the rest; a tile's expert is the number of experts whose tiles (of
    # its kind) end at or before it
    num_local = tl.sum(local_G, axis=0)
    local_end = tl.cumsum(local_G, axis=0)
    rest_end = tl.cumsum(rest_G, axis=0)
    for t0 in range(pid * BLOCK_T, max_tiles, num_programs * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        is_local = t < num_local
        u = tl.where(is_local, t, t - num_local)[:, None]  # index among the tiles of its kind
        kind_end = tl.where(is_local[:, None], local_end[None, :], rest_end[None, :])
        expert = tl.sum(((kind_end <= u) & (g2 < G)).to(tl.int32), axis=1)
        used = expert < G
        pick = g2 == expert[:, None]
        kind_first = kind_end - tl.where(is_local[:, None], local_G[None, :], rest_G[None, :])
        skip = tl.where(is_local[:, None], 0, local_G[None, :])  # a rest tile follows the local ones
        j = tl.sum(tl.where(pick, u - kind_first + skip, 0), axis=1)
        row0 = tl.sum(tl.where(pick, start_G[None, :], 0), axis=1) + j * BLOCK_M
        row_end = tl.sum(tl.where(pick, end_G[None, :], 0), axis=1)
        keep = t < max_tiles
        tl.store(tiles_ptr + 3 * t, tl.where(used, expert, -1), mask=keep)
        tl.store(tiles_ptr + 3 * t + 1, tl.where(used, row0, 0), mask=keep)
        tl.store(tiles_ptr + 3 * t + 2, tl.where(used, row_end, 0), mask=keep)
