"""Routing tables on the device: expert-sorted rows, per-expert offsets and the GEMM tile table.

Legend: T tokens, K top-k, G local experts, S = T*K slots, R = S rows (static: dropped slots sort
last and no tile covers them), X tile-table capacity ``ceil(R / BLOCK_M) + G``.

Small Triton launches on static shapes build the tables (no host sync, so the op captures in a CUDA
graph), as a stable counting sort over bins: the experts, then ``G`` for dropped slots, then ``G + 1``
for ids outside ``[-1, G)`` (counted so that a check costs no extra pass)::

    block histograms  counts[b, e] = #slots of block b in bin e
    totals            totals[e] = sum_b counts[b, e]                  (programs split the bins)
    offsets           expert_start = exclusive cumsum over e of totals[e];
                      base[b, e] = expert_start[e] + sum_{b' < b} counts[b', e]; the tile table
    scatter           row(s) = base[block(s), e(s)] + #earlier slots of block(s) in bin e(s)

Few slots (``S * bins <= ONE_PROGRAM_CELLS``) take one launch instead of four: one program runs the
histogram over all blocks, the offsets, then the scatter, carrying each bin's next row.

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
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.opaque import opaque_op
from megamoe.backends.triton.grid import cdiv, next_power_of_2

ONE_PROGRAM_CELLS = 1 << 16
"""slots x bins up to which one program builds the whole plan (four launches become one: at small T the
host's time per launch is the layer's time); past it the passes below run over many programs."""

OFFSET_COLUMNS = 16
"""expert bins per program of the totals and offsets kernels: the [blocks, bins] count matrix is read by
columns in parallel (at 128 experts it is 2048 x 256, too slow for one program:
docs/kernels.md#measurements-that-chose-the-design)."""


def tile_table_rows(rows: int, experts: int, block_m: int) -> int:
    """Rows of a tile table over ``rows`` expert-sorted rows: one per BLOCK_M rows, plus one per expert
    for its partial last tile."""
    return cdiv(rows, block_m) + experts


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

    def kernel_tables(self) -> tuple[int, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """What the kernels of :mod:`megamoe.backends.triton.ops` take after ``topk``."""
        return (
            self.block_m,
            self.row_token_R,
            self.slot_row_S,
            self.expert_start_G1,
            self.tiles_X3,
            self.num_tiles_1,
        )

    @property
    def max_tiles(self) -> int:
        return int(self.tiles_X3.shape[0])

    def row_values_R(self, values_TK: Tensor) -> Tensor:
        """``values_TK`` of each row's (token, k) slot, in row order: ``[T * K]``, zero for the rows of
        dropped slots (past ``expert_start_G1[-1]``); the inverse of :meth:`slot_values_TK`."""
        return pick_rows(values_TK.reshape(-1), self.row_slot_R, self.expert_start_G1)

    def slot_values_TK(self, values_R: Tensor) -> Tensor:
        """``values_R`` read back at each (token, k) slot's row: ``[T, K]``, zero for dropped slots."""
        return pick_slots(values_R, self.slot_row_S).view(self.num_tokens, self.topk)


_PICK_BLOCK = 1024


@opaque_op("megamoe_triton::pick_rows")
def pick_rows(values_S: Tensor, row_slot_R: Tensor, expert_start_G1: Tensor) -> Tensor:
    """``out[r] = values_S[row_slot_R[r]]`` for the valid rows, else 0: one launch each way, not a chain
    of torch ops, since at small T the host's time per launch is the layer's time."""
    out = torch.empty_like(values_S)
    if out.numel():
        grid = (cdiv(out.numel(), _PICK_BLOCK),)
        _pick_rows_kernel[grid](
            values_S, row_slot_R, expert_start_G1[-1:], out, out.numel(), BLOCK=_PICK_BLOCK
        )
    return out


@pick_rows.register_fake
def _(values_S, row_slot_R, expert_start_G1):
    return torch.empty_like(values_S)


@opaque_op("megamoe_triton::pick_slots")
def pick_slots(values_R: Tensor, slot_row_S: Tensor) -> Tensor:
    """``out[s] = values_R[slot_row_S[s]]``, 0 where the slot was dropped (``slot_row_S[s] = -1``)."""
    out = values_R.new_empty(slot_row_S.shape)
    if out.numel():
        grid = (cdiv(out.numel(), _PICK_BLOCK),)
        _pick_slots_kernel[grid](values_R, slot_row_S, out, out.numel(), BLOCK=_PICK_BLOCK)
    return out


@pick_slots.register_fake
def _(values_R, slot_row_S):
    return values_R.new_empty(slot_row_S.shape)


@triton.jit
def pick_row_values(values_ptr, row_slot_ptr, out_ptr, rows, valid, R):
    """``out[r] = values[row_slot[r]]`` for the ``rows`` below ``valid``, 0 for the others below ``R``: the
    one formula of :func:`pick_rows` and of GEMM1's programs, which pick the routing weights beside
    their tiles."""
    live = rows < valid
    slot = tl.load(row_slot_ptr + rows, mask=live, other=0)
    tl.store(out_ptr + rows, tl.load(values_ptr + slot, mask=live, other=0), mask=rows < R)


@triton.jit
def pick_slot_value(values_ptr, row, out_ptr, slot, mask):
    """``out[slot] = values[row]`` where ``mask``, 0 for a dropped slot (``row < 0``): the one formula of
    :func:`pick_slots` and of the combine, which carries the routing-weight gradient back beside ``dx``."""
    tl.store(out_ptr + slot, tl.load(values_ptr + row, mask=row >= 0, other=0), mask=mask)


@triton.jit
def _pick_rows_kernel(values_ptr, row_slot_ptr, valid_rows_ptr, out_ptr, R, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pick_row_values(values_ptr, row_slot_ptr, out_ptr, rows, tl.load(valid_rows_ptr), R)


@triton.jit
def _pick_slots_kernel(values_ptr, slot_row_ptr, out_ptr, S, BLOCK: tl.constexpr):
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(slot_row_ptr + slots, mask=slots < S, other=-1)
    pick_slot_value(values_ptr, row, out_ptr, slots, slots < S)


@triton.jit
def _slot_keys(idx_ptr, slots, S, G, BINS: tl.constexpr):
    """Each slot's bin: its expert, ``G`` for a dropped slot (-1), ``G + 1`` for an id outside
    ``[-1, G)``; ``BINS`` (no bin) past ``S``."""
    expert = tl.load(idx_ptr + slots, mask=slots < S, other=-1)
    key = tl.where((expert >= 0) & (expert < G), expert, tl.where(expert == -1, G, G + 1)).to(tl.int32)
    return tl.where(slots < S, key, BINS)


@triton.jit
def _onehot(key, BINS: tl.constexpr):
    return (key[:, None] == tl.arange(0, BINS)[None, :]).to(tl.int32)


@triton.jit
def _store_rows(slots, key, onehot, base, row_slot_ptr, row_token_ptr, slot_row_ptr, S, G, K):
    """Scatter a block of slots to their rows: ``base`` (per slot) plus the number of earlier slots of
    the block in the same bin, so that equal experts keep slot order."""
    in_range = slots < S
    row = base + tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    tl.store(row_slot_ptr + row, slots, mask=in_range)
    tl.store(row_token_ptr + row, slots // K, mask=in_range)
    tl.store(slot_row_ptr + slots, tl.where(key < G, row, -1), mask=in_range)


@triton.jit
def _store_plan_offsets(
    total,
    expert_start_ptr,
    tiles_ptr,
    num_tiles_ptr,
    ids_ok_ptr,
    G,
    max_tiles,
    first_chunk,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """From the bin totals: expert offsets, the used tile count and whether every id was valid (when
    ``first_chunk`` is 0), and every ``num_programs``-th ``CHUNK`` of the tile table from
    ``first_chunk`` on. Returns each bin's first row."""
    bins = tl.arange(0, BINS)
    chunk = tl.arange(0, CHUNK)
    start = tl.cumsum(total, axis=0) - total
    is_expert = bins < G
    tiles = tl.where(is_expert, (total + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    if first_chunk == 0:
        tl.store(expert_start_ptr + bins, start, mask=bins <= G)
        tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
        tl.store(ids_ok_ptr, (tl.sum(tl.where(bins == G + 1, total, 0), axis=0) == 0).to(tl.int32))
    seg_end = tl.where(is_expert, start + total, 0)
    for t0 in range(first_chunk, max_tiles, tl.num_programs(0) * CHUNK):
        tile = t0 + chunk
        # expert of a tile = number of experts whose tiles all end at or before it
        expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & is_expert[None, :]).to(tl.int32), axis=1)
        pick = bins[None, :] == expert[:, None]
        first_tile = tl.sum(tl.where(pick, tile_end - tiles, 0), axis=1)
        row0 = tl.sum(tl.where(pick, start, 0), axis=1) + (tile - first_tile) * BLOCK_M
        used = expert < G
        row_end = tl.sum(tl.where(pick, seg_end, 0), axis=1)
        ok = tile < max_tiles
        tl.store(tiles_ptr + 3 * tile, tl.where(used, expert, -1), mask=ok)
        tl.store(tiles_ptr + 3 * tile + 1, tl.where(used, row0, 0), mask=ok)
        tl.store(tiles_ptr + 3 * tile + 2, tl.where(used, row_end, 0), mask=ok)
    return start


@triton.jit
def _one_program_kernel(
    idx_ptr,
    row_slot_ptr,
    row_token_ptr,
    slot_row_ptr,
    expert_start_ptr,
    tiles_ptr,
    num_tiles_ptr,
    ids_ok_ptr,
    S,
    G,
    K,
    max_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The whole plan in one program, for few slots: a histogram pass over the slots, the offsets, then
    a scatter pass that carries each bin's next free row from block to block."""
    total = tl.zeros((BINS,), dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        total += tl.sum(_onehot(_slot_keys(idx_ptr, s0 + tl.arange(0, BLOCK_S), S, G, BINS), BINS), axis=0)
    next_row = _store_plan_offsets(
        total, expert_start_ptr, tiles_ptr, num_tiles_ptr, ids_ok_ptr, G, max_tiles, 0,
        BLOCK_M=BLOCK_M, BINS=BINS, CHUNK=CHUNK,
    )  # fmt: skip
    for s0 in range(0, S, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        key = _slot_keys(idx_ptr, slots, S, G, BINS)
        onehot = _onehot(key, BINS)
        base = tl.sum(onehot * next_row[None, :], axis=1)
        _store_rows(slots, key, onehot, base, row_slot_ptr, row_token_ptr, slot_row_ptr, S, G, K)
        next_row += tl.sum(onehot, axis=0)


@triton.jit
def _histogram_kernel(idx_ptr, counts_ptr, S, G, BLOCK_S: tl.constexpr, BINS: tl.constexpr):
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    onehot = _onehot(_slot_keys(idx_ptr, slots, S, G, BINS), BINS)
    tl.store(counts_ptr + tl.program_id(0) * BINS + tl.arange(0, BINS), tl.sum(onehot, axis=0))


@triton.jit
def _totals_kernel(
    counts_ptr, totals_ptr, num_blocks, BINS: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr
):
    """``totals[e] = sum_b counts[b, e]`` for this program's ``COLS`` bins."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    chunk = tl.arange(0, CHUNK)
    total = tl.zeros((COLS,), dtype=tl.int32)
    for b0 in range(0, num_blocks, CHUNK):
        ptrs = counts_ptr + (b0 + chunk)[:, None] * BINS + cols[None, :]
        total += tl.sum(tl.load(ptrs, mask=(b0 + chunk < num_blocks)[:, None], other=0), axis=0)
    tl.store(totals_ptr + cols, total)


@triton.jit
def _offsets_kernel(
    counts_ptr,
    totals_ptr,
    base_ptr,
    expert_start_ptr,
    tiles_ptr,
    num_tiles_ptr,
    ids_ok_ptr,
    num_blocks,
    G,
    max_tiles,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Every program derives the expert offsets and tile counts from the totals (``BINS`` numbers); each
    writes the block bases of its ``COLS`` bins and every ``num_programs``-th chunk of the tile table."""
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    chunk = tl.arange(0, CHUNK)
    start = _store_plan_offsets(
        tl.load(totals_ptr + bins), expert_start_ptr, tiles_ptr, num_tiles_ptr, ids_ok_ptr, G, max_tiles,
        pid * CHUNK, BLOCK_M=BLOCK_M, BINS=BINS, CHUNK=CHUNK,
    )  # fmt: skip
    # base[b, e] = start[e] + sum_{b' < b} counts[b', e], for my bins
    cols = pid * COLS + tl.arange(0, COLS)
    carry = tl.sum(tl.where(bins[None, :] == cols[:, None], start[None, :], 0), axis=1)
    for b0 in range(0, num_blocks, CHUNK):
        rows_ok = (b0 + chunk < num_blocks)[:, None]
        ptrs = (b0 + chunk)[:, None] * BINS + cols[None, :]
        c = tl.load(counts_ptr + ptrs, mask=rows_ok, other=0)
        tl.store(base_ptr + ptrs, carry[None, :] + tl.cumsum(c, axis=0) - c, mask=rows_ok)
        carry += tl.sum(c, axis=0)


@triton.jit
def _scatter_kernel(
    idx_ptr,
    base_ptr,
    row_slot_ptr,
    row_token_ptr,
    slot_row_ptr,
    S,
    G,
    K,
    BLOCK_S: tl.constexpr,
    BINS: tl.constexpr,
):
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    key = _slot_keys(idx_ptr, slots, S, G, BINS)
    base = tl.load(base_ptr + tl.program_id(0) * BINS + key, mask=slots < S, other=0)
    _store_rows(slots, key, _onehot(key, BINS), base, row_slot_ptr, row_token_ptr, slot_row_ptr, S, G, K)


def build_routing_plan(
    topk_idx_TK: Tensor, *, num_experts: int, block_m: int, check_ids: bool = False
) -> RoutingPlan:
    """Sort the (token, k) slots by expert and cut each expert's rows into BLOCK_M tiles, on device.

    ``check_ids``: fail (asynchronously, as a device-side assert) if an id is outside ``[-1, G)``;
    the tables count such ids anyway, so the check costs one launch and no pass over ``topk_idx``."""
    T, K = topk_idx_TK.shape
    S, G = T * K, num_experts
    device = topk_idx_TK.device
    interpret = device.type != "cuda"
    bins = next_power_of_2(G + 2)  # the experts, dropped slots, invalid ids
    block_s = 16 if interpret else max(16, min(1024, 16384 // bins))
    num_blocks = cdiv(S, block_s)
    warps = 1 if interpret else 8
    max_tiles = tile_table_rows(S, G, block_m)
    idx_S = topk_idx_TK.reshape(-1)
    row_slot_R = torch.empty(S, dtype=torch.int32, device=device)
    row_token_R = torch.empty(S, dtype=torch.int32, device=device)
    slot_row_S = torch.empty(S, dtype=torch.int32, device=device)
    expert_start_G1 = torch.empty(G + 1, dtype=torch.int32, device=device)
    tiles_X3 = torch.empty(max_tiles, 3, dtype=torch.int32, device=device)
    num_tiles_1 = torch.empty(1, dtype=torch.int32, device=device)
    ids_ok_1 = torch.empty(1, dtype=torch.int32, device=device)
    chunk = 16 if interpret else max(16, min(256, 8192 // bins))  # [chunk, bins] tiles of 8K: no spills
    tables = (expert_start_G1, tiles_X3, num_tiles_1, ids_ok_1)
    if S * bins <= ONE_PROGRAM_CELLS:
        _one_program_kernel[(1,)](
            idx_S, row_slot_R, row_token_R, slot_row_S, *tables, S, G, K, max_tiles,
            BLOCK_M=block_m, BLOCK_S=block_s, BINS=bins, CHUNK=chunk, num_warps=warps,
        )  # fmt: skip
    else:
        counts = torch.empty(num_blocks, bins, dtype=torch.int32, device=device)
        base = torch.empty_like(counts)
        totals = torch.empty(bins, dtype=torch.int32, device=device)
        cols = min(bins, OFFSET_COLUMNS)
        _histogram_kernel[(num_blocks,)](idx_S, counts, S, G, BLOCK_S=block_s, BINS=bins, num_warps=warps)
        _totals_kernel[(bins // cols,)](
            counts, totals, num_blocks, BINS=bins, COLS=cols, CHUNK=chunk, num_warps=warps
        )
        _offsets_kernel[(bins // cols,)](
            counts, totals, base, *tables, num_blocks, G, max_tiles,
            BLOCK_M=block_m, BINS=bins, COLS=cols, CHUNK=chunk, num_warps=warps,
        )  # fmt: skip
        _scatter_kernel[(num_blocks,)](
            idx_S, base, row_slot_R, row_token_R, slot_row_S, S, G, K, BLOCK_S=block_s, BINS=bins,
            num_warps=warps,
        )  # fmt: skip
    if check_ids:
        torch._assert_async(ids_ok_1, f"topk_idx: expert ids must be in [0, {G}) or -1 for a dropped slot")
    return RoutingPlan(
        num_tokens=T,
        topk=K,
        num_experts=G,
        block_m=block_m,
        row_slot_R=row_slot_R,
        row_token_R=row_token_R,
        slot_row_S=slot_row_S,
        expert_start_G1=expert_start_G1,
        tiles_X3=tiles_X3,
        num_tiles_1=num_tiles_1,
    )


def build_received_plan(rows_per_expert: list[int], *, block_m: int, device: torch.device) -> RoutingPlan:
    """The plan of rows already sorted by local expert (what an all-to-all exchange received:
    ``rows_per_expert[g]`` rows of expert g, in order), as rows of one slot each."""
    counts = torch.tensor(rows_per_expert, device=device)
    expert_R1 = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts).unsqueeze(1)
    return build_routing_plan(expert_R1, num_experts=len(rows_per_expert), block_m=block_m)
