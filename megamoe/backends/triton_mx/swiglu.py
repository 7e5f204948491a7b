"""The SwiGLU passes of the MXFP8 path (:mod:`megamoe.backends.triton.swiglu_quant`'s kernels with MX's
32-element blocks), each emitting the MX operand of the next GEMM:

    forward:  q(a) rowwise along I                                           (fc2's A operand)
    backward: dh, d_w, and q(w a) in 32-row blocks along R per expert, transposed [I, 32 NB]
              (dW2's Q operand); the padding rows of dh and d_w zeroed in the same launch
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.triton import swiglu_quant as passes
from megamoe.backends.triton.grid import next_power_of_2
from megamoe.backends.triton_mx.mx_math import quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_mx.quantize_rows import empty_rows_mx
from megamoe.quant.mx import BLOCK, MXTensor


def swiglu_quant(h_R2I: Tensor, valid_rows_1: Tensor) -> MXTensor:
    """``q(silu(gate) * up)`` rowwise along I, ``[R, I]`` (codes block-major); padding rows unwritten."""
    I = h_R2I.shape[1] // 2
    out = empty_rows_mx(h_R2I.shape[0], I, h_R2I.device)
    interpret = h_R2I.device.type != "cuda"
    block_i = min(next_power_of_2(max(I, BLOCK)), 64 if interpret else 256)
    passes.swiglu_quant(
        h_R2I, valid_rows_1, out.data, out.scale, tile=BLOCK, tiles=block_i // BLOCK,
        block_r=8 if interpret else max(1, 4096 // block_i), quantize_along_cols=quantize_along_cols,
        num_warps=1 if interpret else 4,
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
) -> MXTensor:
    """Write ``dh`` (contiguous) and ``d_weight`` (fp32): the routed rows' values, zeros on the padding
    rows; return ``q(w a)`` along R, packed ``[I, 32 num_blocks]`` like
    :func:`~megamoe.backends.triton_mx.quantize_segments.quantize_segments`."""
    I = da_RI.shape[1]
    aw = MXTensor(
        data=torch.empty(I, num_blocks * BLOCK, dtype=torch.float8_e4m3fn, device=h_R2I.device),
        scale=torch.empty(num_blocks, I, dtype=torch.uint8, device=h_R2I.device).t(),
        dim=1,
    )
    interpret = h_R2I.device.type != "cuda"
    passes.swiglu_backward_quant(
        h_R2I, da_RI, weight_R, dh_R2I, d_weight_R, row_start_G1, block_start_G1, aw.data, aw.scale,
        tile=BLOCK, block_i=min(next_power_of_2(max(I, BLOCK)), 32 if interpret else 64),  # 128: 255 registers, spills
        quantize_along_rows=quantize_along_rows, num_warps=1 if interpret else 4,
    )  # fmt: skip
    return aw
