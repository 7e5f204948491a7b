"""MX quantisation along R inside each segment of rows, written transposed: the wgrad operands.

Legend: R rows (expert-sorted), X columns, G segments (experts) ``[row_start[g], row_start[g+1])``,
NB block slots. A weight gradient ``dW[g] = P_g^T Q_g`` sums over R, so its operands are blocked along
R, and blocks start at each expert's first row (a block never straddles two experts; the last one is
short, read as zero-padded). Hopper's FP8 MMA wants both operands K-major, so the E4M3 data is
written transposed, R contiguous::

    for (block slot j, column tile) in grid:
        g = the segment whose blocks [block_start[g], block_start[g+1]) hold j    # ceil(rows / 32) each
        v[i, x] = src[index[row_start[g] + 32 (j - block_start[g]) + i], x]      # 0 past the segment end
        code[x] = e8m0(amax_i |v[i, x]|);  out[x, 32 j + i] = e4m3(v[i, x] / 2**(code[x] - 127))

``packed`` output (the wgrad operands): ``data [X, 32 NB]``, segment g at columns ``32 block_start[g]``
on, zero lanes written past its end, so a K loop over a segment's blocks reads no other expert; codes
``[X, NB]``. Not packed (the weight cache's transposed form ``w^T [G, X, Y]``): each segment starts a
new ``[X, Y]`` matrix and only its ``Y`` lanes are written. ``index`` fuses the dispatch gather
(``x`` and ``dy`` are read through ``row_token``, no sorted copy). Bit-identical to
``quantize_mx(src[segment], dim=0)`` per segment.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.rows_quant import check_rows
from megamoe.backends.triton.segments import block_starts, quantize_segments_kernel
from megamoe.backends.triton_mx.mx_math import quantize_along_rows
from megamoe.quant.mx import BLOCK, MXTensor


def segment_block_starts(row_start_G1: Tensor, *, align: int = 1) -> Tensor:
    """``block_start [G + 1]`` (int32, on the device, no sync): exclusive prefix sum of ``ceil(rows / 32)``
    rounded up to a multiple of ``align`` (the padding slots are all-zero blocks, so a wgrad stage of
    ``align`` blocks never reaches the next segment). A static bound on the slots: ``ceil(R / 32) + G * align``.
    One launch."""
    return block_starts(row_start_G1, block=BLOCK, align=align)


def _launch(
    src_RX: Tensor,
    index_R: Tensor | None,
    row_start_G1: Tensor,
    block_start_G1: Tensor,
    num_blocks: int,
    data: Tensor,
    scale: Tensor,
    strides: tuple[int, int, int, int, int],
    packed: bool,
    whole_blocks: bool = False,
) -> None:
    X = src_RX.shape[1]
    G = row_start_G1.shape[0] - 1
    if num_blocks == 0 or X == 0 or G == 0:
        return
    interpret = src_RX.device.type != "cuda"
    block_x = min(next_power_of_2(X), 32 if interpret else 128)
    quantize_segments_kernel[(num_blocks, cdiv(X, block_x))](
        src_RX,
        index_R,
        row_start_G1,
        block_start_G1,
        data.view(torch.uint8),
        scale,
        G,
        X,
        src_RX.stride(0),
        *strides,
        HAS_INDEX=index_R is not None,
        PACKED=packed,
        WHOLE_BLOCKS=whole_blocks,
        BINS=next_power_of_2(G),
        BLOCK_X=block_x,
        TILE=BLOCK,
        QUANTIZE_ALONG_ROWS=quantize_along_rows,
        num_warps=1 if interpret else 4,
    )


def quantize_segments(
    src_RX: Tensor,
    row_start_G1: Tensor,
    block_start_G1: Tensor,
    num_blocks: int,
    *,
    index_R: Tensor | None = None,
    out: MXTensor | None = None,
) -> MXTensor:
    """The packed wgrad operand: ``data [X, 32 num_blocks]`` E4M3 (segment g from column
    ``32 block_start[g]``), codes ``[X, num_blocks]`` (stored block-major), written into ``out`` when
    given. ``num_blocks`` is a static bound (``ceil(R / 32) + G``); columns past ``32 block_start[G]``
    are left unwritten and never read. Rows are ``src_RX[index_R[r]]`` when ``index_R`` is given (the
    fused dispatch gather)."""
    check_rows(src_RX)
    X = src_RX.shape[1]
    if out is None:
        out = MXTensor(
            data=torch.empty(X, num_blocks * BLOCK, dtype=torch.float8_e4m3fn, device=src_RX.device),
            scale=torch.empty(num_blocks, X, dtype=torch.uint8, device=src_RX.device).t(),
            dim=1,
        )
    data, scale = out.data, out.scale
    _launch(
        src_RX,
        index_R,
        row_start_G1,
        block_start_G1,
        num_blocks,
        data,
        scale,
        (0, data.stride(0), 0, scale.stride(0), scale.stride(1)),
        packed=True,
    )
    return out


def quantize_transposed_weight(w_GYX: Tensor, out: MXTensor) -> None:
    """Write ``w^T [G, X, Y]`` blocked along Y (each expert alone) into ``out``: the dgrad weight form.

    Equal to ``quantize_mx(w.transpose(1, 2), dim=-1)``; ``out.scale`` may be any strided ``[G, X, B]``.
    """
    G, Y, X = w_GYX.shape
    w = w_GYX.contiguous()
    nb = -(-Y // BLOCK)
    if tuple(out.data.shape) != (G, X, Y) or not out.data.is_contiguous():
        raise ValueError(f"out: expected contiguous MX buffers [{G}, {X}, {Y}], got {tuple(out.data.shape)}")
    starts = torch.arange(G + 1, dtype=torch.int32, device=w.device)
    _launch(
        w.view(G * Y, X),
        None,
        starts * Y,
        starts * nb,
        G * nb,
        out.data,
        out.scale,
        (X * Y, Y, out.scale.stride(0), out.scale.stride(1), out.scale.stride(2)),
        packed=False,
        whole_blocks=Y % BLOCK == 0,  # every block of every expert full: no lane mask on the stores
    )
