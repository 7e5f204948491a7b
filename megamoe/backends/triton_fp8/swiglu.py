"""The SwiGLU passes of the FP8 path (:mod:`megamoe.backends.triton.swiglu_quant`'s kernels with
blockwise FP8's 128-element tiles), each emitting the FP8 operand of the next GEMM:

    forward:  t(a) rowwise in 1×128 tiles along I                            (fc2's A operand)
    backward: dh, d_w, and t(w a) in 128-row tiles along R per expert, transposed [I, 128 NB]
              (dW2's Q operand); the padding rows of dh and d_w zeroed in the same launch
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.swiglu_quant import swiglu_backward_quant_kernel, swiglu_quant_kernel
from megamoe.backends.triton_fp8.fp8_math import TILE, quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_fp8.quantize import empty_rows, empty_segments, row_block
from megamoe.quant.fp8 import FP8Tensor


def swiglu_quant(h_R2I: Tensor, valid_rows_1: Tensor) -> FP8Tensor:
    """``t(silu(gate) * up)`` in 1×128 tiles along I, ``[R, I]``; padding rows unwritten."""
    R, I = h_R2I.shape[0], h_R2I.shape[1] // 2
    out = empty_rows(R, I, h_R2I.device)
    if R == 0 or I == 0:
        return out
    block_r, tiles = row_block(I, h_R2I.device)
    swiglu_quant_kernel[(cdiv(R, block_r), cdiv(I, tiles * TILE))](
        h_R2I,
        out.data.view(torch.uint8),
        out.scale,
        valid_rows_1,
        I,
        out.scale.stride(0),
        out.scale.stride(1),
        BLOCK_R=block_r,
        TILES=tiles,
        TILE=TILE,
        QUANTIZE_ALONG_COLS=quantize_along_cols,
        num_warps=4 if h_R2I.device.type == "cuda" else 1,
    )
    return out


def swiglu_backward_quant(
    h_R2I: Tensor,
    da_RI: Tensor,
    weight_R: Tensor,
    dh_R2I: Tensor,
    d_weight_R: Tensor,
    row_start_G1: Tensor,
    block_start_G1: Tensor,
    num_blocks: int,
) -> FP8Tensor:
    """Write ``dh`` (contiguous) and ``d_weight`` (fp32): the routed rows' values, zeros on the padding
    rows; return ``t(w a)`` along R, packed ``[I, 128 num_blocks]`` like
    :func:`~megamoe.backends.triton_fp8.quantize.quantize_segments`."""
    R, I = da_RI.shape
    G = row_start_G1.shape[0] - 1
    aw = empty_segments(I, num_blocks, h_R2I.device)
    if I == 0 or G == 0:
        d_weight_R.zero_()
    if R == 0 or I == 0 or G == 0 or num_blocks == 0:
        return aw
    if not dh_R2I.is_contiguous():
        raise ValueError("dh must be contiguous: the kernel zeroes its padding rows as [R, 2I]")
    cuda = h_R2I.device.type == "cuda"
    swiglu_backward_quant_kernel[(num_blocks,)](
        h_R2I,
        da_RI,
        weight_R,
        dh_R2I,
        d_weight_R,
        aw.data.view(torch.uint8),
        aw.scale,
        row_start_G1,
        block_start_G1,
        R,
        G,
        I,
        aw.data.stride(0),
        aw.scale.stride(0),
        aw.scale.stride(1),
        BINS=next_power_of_2(G),
        BLOCK_I=min(next_power_of_2(I), 32 if cuda else 16),
        TILE=TILE,
        QUANTIZE_ALONG_ROWS=quantize_along_rows,
        num_warps=8 if cuda else 1,
    )
    return aw
