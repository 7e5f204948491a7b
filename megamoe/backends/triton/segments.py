"""Where each expert's row blocks start in a blocked along-R operand (the quantised wgrad operands).

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
