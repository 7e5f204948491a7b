"""Rowwise MX quantisation: ``[R, X]`` floats -> E4M3 ``[R, X]`` + one E8M0 code per 32 along each row.

Legend: R rows, X columns (the GEMM's reduction dimension), B = ceil(X / 32) blocks per row.

    for (row tile, column tile) in grid:               # BLOCK_X is a multiple of 32
        v = float32(src[rows, cols])                   # lanes past X read 0: a short last block
        code[r, b] = e8m0(amax |v[r, 32b : 32b+32]|)   # NaN/inf in a block -> 255
        data[r, x] = e4m3(v[r, x] / 2**(code - 127))   # RNE, saturating; code 255 divides by 1

Bit-identical to :func:`megamoe.quant.mx.quantize_mx` along dim 1 (``mx_math`` says how). It is the
producer of every rowwise GEMM operand that is not fused elsewhere: ``x`` and ``dy`` at the source
(before the dispatch: rowwise blocks commute with the row gather, so the GEMMs gather E4M3 rows and
their codes), ``dh`` for the fc1 dgrad, and the weights' forward form in the cache. The scale codes go
to any strided ``[R, B]`` view, so a kernel can read them block-major (coalesced along R).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton_mx.mx_math import quantize_along_cols
from megamoe.quant.mx import BLOCK, MXTensor


@triton.jit
def _quantize_rows_kernel(
    src_ptr,
    data_ptr,
    scale_ptr,
    valid_rows_ptr,
    R,
    X,
    stride_src,
    stride_scale_r,
    stride_scale_b,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    limit = R
    if HAS_VALID:
        limit = tl.minimum(tl.load(valid_rows_ptr), R)
    row_ok = rows < limit
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    mask = row_ok[:, None] & (cols < X)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    v = tl.load(src_ptr + rows64 * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elements, codes = quantize_along_cols(v, BLOCK_X // 32)
    tl.store(data_ptr + rows64 * X + cols[None, :], elements.to(tl.uint8), mask=mask)
    blocks = tl.program_id(1) * (BLOCK_X // 32) + tl.arange(0, BLOCK_X // 32)
    scale_ptrs = scale_ptr + rows64 * stride_scale_r + blocks[None, :].to(tl.int64) * stride_scale_b
    tl.store(scale_ptrs, codes.to(tl.uint8), mask=row_ok[:, None] & (blocks * 32 < X)[None, :])


def empty_rows_mx(rows: int, cols: int, device: torch.device, *, blocks_major: bool = True) -> MXTensor:
    """Uninitialised rowwise MX buffers ``[rows, cols]``; ``blocks_major`` stores the codes as ``[B, rows]``
    (the ``scale`` view is still ``[rows, B]``) so a GEMM reads one block's codes of a row tile in one line."""
    blocks = -(-cols // BLOCK)
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
    if blocks_major:
        scale = torch.empty(blocks, rows, dtype=torch.uint8, device=device).t()
    else:
        scale = torch.empty(rows, blocks, dtype=torch.uint8, device=device)
    return MXTensor(data=data, scale=scale, dim=1)


def quantize_rows(
    src_RX: Tensor, out: MXTensor | None = None, *, valid_rows_1: Tensor | None = None
) -> MXTensor:
    """MX-quantise each row of ``src_RX`` (blocks of 32 along X) into ``out`` (allocated when None).

    ``valid_rows_1`` (a one-element device tensor) limits the work to the first rows; the rest of ``out``
    is left untouched. ``src_RX`` may be any float dtype with unit column stride.
    """
    if src_RX.dim() != 2 or src_RX.stride(1) != 1:
        raise ValueError(
            f"src_RX: expected a [R, X] tensor with unit column stride, got {tuple(src_RX.shape)}"
        )
    R, X = src_RX.shape
    if out is None:
        out = empty_rows_mx(R, X, src_RX.device)
    if (
        tuple(out.data.shape) != (R, X)
        or not out.data.is_contiguous()
        or out.scale.shape[1] != -(-X // BLOCK)
    ):
        raise ValueError(f"out: expected contiguous MX buffers for [{R}, {X}], got {tuple(out.data.shape)}")
    if R == 0 or X == 0:
        return out
    interpret = src_RX.device.type != "cuda"
    block_x = min(next_power_of_2(max(X, BLOCK)), 64 if interpret else 256)
    block_r = 8 if interpret else max(1, 4096 // block_x)
    _quantize_rows_kernel[(cdiv(R, block_r), cdiv(X, block_x))](
        src_RX,
        out.data.view(torch.uint8),
        out.scale,
        valid_rows_1,
        R,
        X,
        src_RX.stride(0),
        out.scale.stride(0),
        out.scale.stride(1),
        HAS_VALID=valid_rows_1 is not None,
        BLOCK_R=block_r,
        BLOCK_X=block_x,
        num_warps=1 if interpret else 4,
    )
    return out
