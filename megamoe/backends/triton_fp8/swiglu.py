"""The SwiGLU passes of the FP8 path (:mod:`megamoe.backends.triton.swiglu_quant`'s kernels with
blockwise FP8's 128-element tiles), each emitting the FP8 operand of the next GEMM:

    forward:  t(a) rowwise in 1×128 tiles along I                            (fc2's A operand)
    backward: dh, d_w, and t(w a) in 128-row tiles along R per expert, transposed [I, 128 NB]
              (dW2's Q operand); the padding rows of dh and d_w zeroed in the same launch
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.triton import swiglu_quant as passes
from megamoe.backends.triton.grid import next_power_of_2
from megamoe.backends.triton_fp8.fp8_math import TILE, quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_fp8.quantize import empty_rows, empty_segments, row_block
from megamoe.quant.fp8 import FP8Tensor


def swiglu_quant(h_R2I: Tensor, valid_rows_1: Tensor) -> FP8Tensor:
    """``t(silu(gate) * up)`` in 1×128 tiles along I, ``[R, I]``; padding rows unwritten."""
    out = empty_rows(h_R2I.shape[0], h_R2I.shape[1] // 2, h_R2I.device)
    block_r, tiles = row_block(out.shape[1], h_R2I.device)
    passes.swiglu_quant(
        h_R2I, valid_rows_1, out.data, out.scale, tile=TILE, tiles=tiles, block_r=block_r,
        quantize_along_cols=quantize_along_cols, num_warps=4 if h_R2I.device.type == "cuda" else 1,
    )  # fmt: skip
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
    I = da_RI.shape[1]
    aw = empty_segments(I, num_blocks, h_R2I.device)
    cuda = h_R2I.device.type == "cuda"
    passes.swiglu_backward_quant(
        h_R2I, da_RI, weight_R, dh_R2I, d_weight_R, row_start_G1, block_start_G1, aw.data, aw.scale,
        tile=TILE, block_i=min(next_power_of_2(I), 32 if cuda else 16), quantize_along_rows=quantize_along_rows,
        num_warps=8 if cuda else 1,
    )  # fmt: skip
    return aw
