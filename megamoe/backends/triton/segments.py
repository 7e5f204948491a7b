"""Where each expert's row blocks start in a blocked along-R operand (the quantised wgrad operands), and
the quantiser that writes such operands for any blockwise format.

A weight gradient sums over an expert's rows, so its quantised operands are cut into blocks of rows that
start at each expert's first row: expert ``g`` gets ``ceil(rows_g / block)`` blocks (rounded up to a
multiple of ``align``), and ``block_start`` is their exclusive prefix sum. One program computes it on
the device from the routing plan's row offsets, in one launch and without a host sync (as torch ops it
took seven launches, each costing the host more than the GPU at small T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import next_power_of_2


@triton.jit
def _block_starts_kernel(
    row_start_ptr, block_start_ptr, G, BLOCK: tl.constexpr, ALIGN: tl.constexpr, BINS: tl.constexpr
):
    g = tl.arange(0, BINS)
    ok = g < G
    rows = tl.load(row_start_ptr + g + 1, mask=ok, other=0) - tl.load(row_start_ptr + g, mask=ok, other=0)
    blocks = (rows + BLOCK - 1) // BLOCK
    blocks = (blocks + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(blocks, 0)
    tl.store(block_start_ptr + g, ends - blocks, mask=ok)
    tl.store(block_start_ptr + G, tl.sum(blocks, 0))


@triton.jit
def segment_of_block(block_start_ptr, block, G, BINS: tl.constexpr):
    """Segment (expert) ``g`` holding the block slot ``block``, and ``block_start[g]``.

    ``block_start [G + 1]`` is the exclusive prefix sum of each segment's block count; a slot at or
    past ``block_start[G]`` gets ``g = G`` (no segment).
    """
    bins = tl.arange(0, BINS)
    ends = tl.load(block_start_ptr + 1 + bins, mask=bins < G, other=2147483647)
    g = tl.sum((ends <= block).to(tl.int32), axis=0)
    return g, tl.load(block_start_ptr + tl.minimum(g, G))


@triton.jit
def quantize_segments_kernel(
    src_ptr,
    index_ptr,
    row_start_ptr,
    block_start_ptr,
    data_ptr,
    scale_ptr,
    G,
    X,
    stride_src,
    data_seg,
    data_x,
    scale_seg,
    scale_x,
    scale_b,
    HAS_INDEX: tl.constexpr,
    PACKED: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_X: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZE_ALONG_ROWS: tl.constexpr,
):
    """Quantise ``src``'s rows along R inside each segment, in ``TILE``-row blocks that start at the
    segment's first row, and write them transposed (R contiguous: what Hopper's FP8 MMA reads for a
    weight gradient). Program ``(j, x)``: block slot ``j`` of segment ``g``, ``BLOCK_X`` columns; rows
    ``src[index[r]]`` with ``HAS_INDEX`` (the fused dispatch gather), zeros past the segment's end.

    ``PACKED`` (the wgrad operands): ``data [X, TILE NB]``, slot ``j`` at columns ``TILE j`` on, every
    lane written. Not packed (a weight's transposed form ``w^T [G, X, Y]``): segment ``g`` is its own
    matrix at ``g data_seg``, only its rows' lanes written (all of them with ``WHOLE_BLOCKS``). The
    format is ``TILE`` and ``QUANTIZE_ALONG_ROWS(v [TILE, BX]) -> (E4M3 bytes, one scale per column)``,
    stored in the scale buffer's dtype."""
    block = tl.program_id(0)
    g, first_block = segment_of_block(block_start_ptr, block, G, BINS)
    if g < G:
        local = block - first_block
        lanes = tl.arange(0, TILE)
        rows = tl.load(row_start_ptr + g) + local * TILE + lanes
        row_ok = rows < tl.load(row_start_ptr + g + 1)
        if HAS_INDEX:
            src_rows = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src_rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
        col_ok = cols < X
        v = tl.load(
            src_ptr + src_rows[:, None] * stride_src + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        elements, scales = QUANTIZE_ALONG_ROWS(v)
        slot = block if PACKED else local
        base = g.to(tl.int64) * data_seg + slot.to(tl.int64) * TILE
        ptrs = data_ptr + base + cols[:, None].to(tl.int64) * data_x + lanes[None, :]
        if PACKED or WHOLE_BLOCKS:
            # a mask constant along the lanes: the compiler writes 16-byte vectors (a row_ok mask, whose
            # start the compiler cannot prove aligned, splits every store into single bytes; measured in
            # docs/mxfp8.md, "The GPU kernels")
            store_ok = col_ok[:, None] & (lanes < TILE)[None, :]
        else:
            store_ok = col_ok[:, None] & row_ok[None, :]
        tl.store(ptrs, tl.trans(elements).to(tl.uint8), mask=store_ok)
        scale_ptrs = scale_ptr + g.to(tl.int64) * scale_seg + cols.to(tl.int64) * scale_x + slot * scale_b
        tl.store(scale_ptrs, scales.to(scale_ptr.dtype.element_ty), mask=col_ok)


def block_starts(row_start_G1: Tensor, *, block: int, align: int = 1) -> Tensor:
    """``block_start [G + 1]`` (int32, on ``row_start_G1``'s device): the exclusive prefix sum over the
    experts of ``ceil(rows / block)`` rounded up to a multiple of ``align``, where expert ``g`` has rows
    ``[row_start[g], row_start[g + 1])``. A static bound on the last entry: ``ceil(R / block) + G * align``."""
    G = row_start_G1.numel() - 1
    block_start = torch.empty(G + 1, dtype=torch.int32, device=row_start_G1.device)
    _block_starts_kernel[(1,)](
        row_start_G1, block_start, G, BLOCK=block, ALIGN=align, BINS=max(next_power_of_2(G), 2), num_warps=1
    )
    return block_start
