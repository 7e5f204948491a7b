"""The rowwise quantiser of any blockwise format: ``[R, X]`` floats into E4M3 ``[R, X]`` and one scale per
``TILE`` columns of each row (MXFP8's 32 with E8M0 codes, FP8's 128 with float32 scales).

It makes every rowwise GEMM operand that no other kernel makes on the way: ``x`` and ``dy`` at the
source (rowwise tiles move with their rows, so the GEMMs gather quantised rows), and ``dh`` for fc1's
dgrad. The format comes in as compile-time arguments, as in :mod:`.segments` and :mod:`.swiglu_quant`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv


@triton.jit
def quantize_rows_kernel(
    src_ptr,
    data_ptr,
    scale_ptr,
    valid_rows_ptr,
    R,
    X,
    stride_src,
    stride_data,
    stride_scale_r,
    stride_scale_k,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_X: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZE_ALONG_COLS: tl.constexpr,
):
    """Program ``(i, j)``: rows ``[i BLOCK_R, (i + 1) BLOCK_R)`` (below ``valid_rows[0]`` with ``HAS_VALID``),
    columns ``[j BLOCK_X, (j + 1) BLOCK_X)``. The format is ``TILE`` and ``QUANTIZE_ALONG_COLS(v [BR, n TILE],
    n) -> (E4M3 bytes, scales [BR, n])``, the scales stored in the scale buffer's dtype, at any strides."""
    TILES: tl.constexpr = BLOCK_X // TILE
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    limit = R
    if HAS_VALID:
        limit = tl.minimum(tl.load(valid_rows_ptr), R)
    row_ok = rows < limit
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    mask = row_ok[:, None] & (cols < X)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    v = tl.load(src_ptr + rows64 * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elements, scales = QUANTIZE_ALONG_COLS(v, TILES)
    tl.store(data_ptr + rows64 * stride_data + cols[None, :], elements.to(tl.uint8), mask=mask)
    tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)
    scale_ptrs = scale_ptr + rows64 * stride_scale_r + tiles[None, :].to(tl.int64) * stride_scale_k
    tl.store(
        scale_ptrs, scales.to(scale_ptr.dtype.element_ty), mask=row_ok[:, None] & (tiles * TILE < X)[None, :]
    )


def check_rows(src_RX: Tensor) -> None:
    """A quantiser's source is ``[R, X]`` with unit column stride (any float dtype, any row stride)."""
    if src_RX.dim() != 2 or src_RX.stride(1) != 1:
        raise ValueError(
            f"src_RX: expected a [R, X] tensor with unit column stride, got {tuple(src_RX.shape)}"
        )


def quantize_rows_into(
    src_RX: Tensor,
    data: Tensor,
    scale: Tensor,
    valid_rows_1: Tensor | None,
    *,
    block_r: int,
    block_x: int,
    tile: int,
    quantize_along_cols,
) -> None:
    """Write ``src_RX``'s rows into ``data [R, X]`` (E4M3, unit column stride) and ``scale [R, ceil(X / tile)]``
    (any strides); ``valid_rows_1`` (a one-element device tensor) limits the work to the first rows, leaving
    the rest unwritten. ``block_x`` is a multiple of ``tile``."""
    R, X = src_RX.shape
    if R == 0 or X == 0:
        return
    quantize_rows_kernel[(cdiv(R, block_r), cdiv(X, block_x))](
        src_RX,
        data.view(torch.uint8),
        scale,
        valid_rows_1,
        R,
        X,
        src_RX.stride(0),
        data.stride(0),
        scale.stride(0),
        scale.stride(1),
        HAS_VALID=valid_rows_1 is not None,
        BLOCK_R=block_r,
        BLOCK_X=block_x,
        TILE=tile,
        QUANTIZE_ALONG_COLS=quantize_along_cols,
        num_warps=4 if src_RX.device.type == "cuda" else 1,
    )
