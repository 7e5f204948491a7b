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
from torch import Tensor

from megamoe.backends.triton.grid import next_power_of_2
from megamoe.backends.triton.rows_quant import check_rows, quantize_rows_into
from megamoe.backends.triton_mx.mx_math import quantize_along_cols
from megamoe.quant.mx import BLOCK, MXTensor


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
    check_rows(src_RX)
    R, X = src_RX.shape
    if out is None:
        out = empty_rows_mx(R, X, src_RX.device)
    if (
        tuple(out.data.shape) != (R, X)
        or not out.data.is_contiguous()
        or out.scale.shape[1] != -(-X // BLOCK)
    ):
        raise ValueError(f"out: expected contiguous MX buffers for [{R}, {X}], got {tuple(out.data.shape)}")
    interpret = src_RX.device.type != "cuda"
    block_x = min(next_power_of_2(max(X, BLOCK)), 64 if interpret else 256)
    quantize_rows_into(
        src_RX,
        out.data,
        out.scale,
        valid_rows_1,
        block_r=8 if interpret else max(1, 4096 // block_x),
        block_x=block_x,
        tile=BLOCK,
        quantize_along_cols=quantize_along_cols,
    )
    return out
