"""SwiGLU passes that emit the quantised operand of the next GEMM, for any blockwise format.

Legend: R rows (expert-sorted; rows ``>= valid`` are padding), I intermediate, h = [gate | up] ``[R, 2I]``,
``w_r`` the routing weight of row r, NB block slots of ``TILE`` rows (each inside one expert's rows).

    forward:  a = silu(gate) * up (fp32)  ->  q(a) in tiles along I                (fc2's A operand)
    backward: da = dy W2 (fp32, without w_r) and h  ->
              dh = swiglu'(h) (w_r da)                                            (h's dtype, to stage 1)
              d_w[r] = <da[r], a[r]>                                              (fp32, unquantised a)
              q(w a) in TILE-row tiles along R per expert, transposed [I, TILE NB] (dW2's Q operand)
              padding rows: dh = 0, d_w = 0

A format is its tile (``TILE`` elements a scale: 128 for blockwise FP8, 32 for MX) and its two
quantisers, passed as compile-time arguments: ``QUANTIZE_ALONG_COLS(v [BR, TILES TILE], TILES)`` and
``QUANTIZE_ALONG_ROWS(v [TILE, BX])``, each returning the E4M3 bytes and one scale per tile (stored in
the scale buffer's dtype: float32 scales or E8M0 codes).

Quantising from the fp32 values in registers is what the emulation does (it never rounds ``a`` or
``w a`` to h's dtype first), and saves a write and a read of ``[R, I]``. The backward walks the
TILE-row blocks of each expert (the wgrad's tiles), so one program owns a whole block: it reads ``h``
and ``da`` once and writes all three outputs, and also zeroes ``TILE`` padding rows of ``dh`` and
``d_w`` (gradients a caller sees), so no memset or zeroing launch runs beside it. The forward's
padding rows are left unwritten: no GEMM tile reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.padding import zero_rows
from megamoe.backends.triton.segments import segment_of_block
from megamoe.backends.triton.swiglu import swiglu_backward_tile, swiglu_tile


@triton.jit
def swiglu_quant_kernel(
    h_ptr,
    data_ptr,
    scale_ptr,
    valid_ptr,
    I,
    stride_scale_r,
    stride_scale_k,
    BLOCK_R: tl.constexpr,
    TILES: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZE_ALONG_COLS: tl.constexpr,
):
    """``q(silu(gate) * up)`` of ``BLOCK_R`` valid rows and ``TILES`` tiles of ``TILE`` columns."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.load(valid_ptr)
    cols = tl.program_id(1) * (TILES * TILE) + tl.arange(0, TILES * TILE)
    mask = row_ok[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elements, scales = QUANTIZE_ALONG_COLS(swiglu_tile(gate, up), TILES)
    tl.store(data_ptr + rows64 * I + cols[None, :], elements.to(tl.uint8), mask=mask)
    tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)
    scale_ptrs = scale_ptr + rows64 * stride_scale_r + tiles[None, :].to(tl.int64) * stride_scale_k
    tl.store(
        scale_ptrs,
        scales.to(scale_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (tiles * TILE < I)[None, :],
    )


@triton.jit
def swiglu_backward_quant_kernel(
    h_ptr,
    da_ptr,
    weight_ptr,
    dh_ptr,
    d_weight_ptr,
    aw_data_ptr,
    aw_scale_ptr,
    row_start_ptr,
    block_start_ptr,
    R,
    G,
    I,
    stride_aw,
    stride_aw_scale_x,
    stride_aw_scale_b,
    BINS: tl.constexpr,
    BLOCK_I: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZE_ALONG_ROWS: tl.constexpr,
):
    """Program ``b``: block slot ``b``'s ``TILE`` rows, then ``TILE`` of the padding rows (the grid has at
    least ``ceil(R / TILE)`` programs, so every padding row is some program's)."""
    block = tl.program_id(0)
    g, first_block = segment_of_block(block_start_ptr, block, G, BINS)
    if g < G:
        lanes = tl.arange(0, TILE)
        rows = tl.load(row_start_ptr + g) + (block - first_block) * TILE + lanes
        live = rows < tl.load(row_start_ptr + g + 1)
        rows64 = rows.to(tl.int64)[:, None]
        weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
        dot = tl.zeros((TILE,), dtype=tl.float32)
        for c0 in range(0, I, BLOCK_I):
            cols = c0 + tl.arange(0, BLOCK_I)
            col_ok = cols < I
            mask = live[:, None] & col_ok[None, :]
            gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            da = tl.load(da_ptr + rows64 * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            act, d_gate, d_up = swiglu_backward_tile(gate, up, da, weight)
            dot += tl.sum(da * act, axis=1)
            dh_row = dh_ptr + rows64 * (2 * I) + cols[None, :]
            tl.store(dh_row, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_row + I, d_up.to(dh_ptr.dtype.element_ty), mask=mask)
            elements, scales = QUANTIZE_ALONG_ROWS(act * weight[:, None])
            aw_ptrs = aw_data_ptr + cols[:, None].to(tl.int64) * stride_aw + block * TILE + lanes[None, :]
            tl.store(aw_ptrs, tl.trans(elements).to(tl.uint8), mask=col_ok[:, None] & (lanes < TILE)[None, :])
            scale_ptrs = aw_scale_ptr + cols.to(tl.int64) * stride_aw_scale_x + block * stride_aw_scale_b
            tl.store(scale_ptrs, scales.to(aw_scale_ptr.dtype.element_ty), mask=col_ok)
        tl.store(d_weight_ptr + rows, dot, mask=live)
    pad0 = tl.load(row_start_ptr + G) + block * TILE
    if pad0 < R:
        pad = pad0 + tl.arange(0, TILE)
        zero_rows(dh_ptr, pad, pad < R, 2 * I, TILE, BLOCK_I)
        tl.store(d_weight_ptr + pad, tl.zeros((TILE,), dtype=d_weight_ptr.dtype.element_ty), mask=pad < R)


def swiglu_quant(
    h_R2I: Tensor,
    valid_rows_1: Tensor,
    data_RI: Tensor,
    scale_RT: Tensor,
    *,
    tile: int,
    tiles: int,
    block_r: int,
    quantize_along_cols: Callable,
    num_warps: int,
) -> None:
    """Launch the forward pass: ``q(silu(gate) * up)`` of the valid rows into a format's rowwise buffers
    (``data [R, I]`` E4M3, ``scale [R, ceil(I / tile)]`` any strides), ``tiles`` tiles a program."""
    R, I = data_RI.shape
    if R == 0 or I == 0:
        return
    swiglu_quant_kernel[(cdiv(R, block_r), cdiv(I, tiles * tile))](
        h_R2I,
        data_RI.view(torch.uint8),
        scale_RT,
        valid_rows_1,
        I,
        scale_RT.stride(0),
        scale_RT.stride(1),
        BLOCK_R=block_r,
        TILES=tiles,
        TILE=tile,
        QUANTIZE_ALONG_COLS=quantize_along_cols,
        num_warps=num_warps,
    )


def swiglu_backward_quant(
    h_R2I: Tensor,
    da_RI: Tensor,
    weight_R: Tensor,
    dh_R2I: Tensor,
    d_weight_R: Tensor,
    row_start_G1: Tensor,
    block_start_G1: Tensor,
    aw_data: Tensor,
    aw_scale: Tensor,
    *,
    tile: int,
    block_i: int,
    quantize_along_rows: Callable,
    num_warps: int,
) -> None:
    """Launch the backward pass: ``dh`` (contiguous) and ``d_weight`` (fp32) written, the routed rows'
    values and zeros on the padding rows, and ``q(w a)`` into a format's packed along-R buffers
    (``aw_data [I, tile NB]`` E4M3, ``aw_scale [I, NB]`` any strides); one program per block slot."""
    R, I = da_RI.shape
    G = row_start_G1.shape[0] - 1
    num_blocks = aw_scale.shape[1]
    if I == 0 or G == 0:
        d_weight_R.zero_()
    if R == 0 or I == 0 or G == 0 or num_blocks == 0:
        return
    if not dh_R2I.is_contiguous():
        raise ValueError("dh must be contiguous: the kernel zeroes its padding rows as [R, 2I]")
    swiglu_backward_quant_kernel[(num_blocks,)](
        h_R2I,
        da_RI,
        weight_R,
        dh_R2I,
        d_weight_R,
        aw_data.view(torch.uint8),
        aw_scale,
        row_start_G1,
        block_start_G1,
        R,
        G,
        I,
        aw_data.stride(0),
        aw_scale.stride(0),
        aw_scale.stride(1),
        BINS=next_power_of_2(G),
        BLOCK_I=block_i,
        TILE=tile,
        QUANTIZE_ALONG_ROWS=quantize_along_rows,
        num_warps=num_warps,
    )
