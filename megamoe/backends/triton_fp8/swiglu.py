"""SwiGLU passes of the FP8 path, each emitting the FP8 operand of the next GEMM (fused quantisation).

Legend: R rows (expert-sorted; rows ``>= valid`` are padding), I intermediate, h = [gate | up] ``[R, 2I]``,
``w_r`` the routing weight of row r, NB 128-row block slots (each inside one expert's rows).

    forward:  a = silu(gate) * up (fp32)  ->  t(a) rowwise in 1×128 tiles along I     (fc2's A operand)
    backward: da = dy W2 (fp32, without w_r) and h  ->
              dh = swiglu'(h) (w_r da)                                              (bf16, to stage 1)
              d_w[r] = <da[r], a[r]>                                                (fp32, unquantised a)
              t(w a) in 128-row tiles along R per expert, transposed [I, 128 NB]    (dW2's Q operand)

Quantising from the fp32 values in registers is what the emulation does (it never rounds ``a`` or
``w a`` to bf16 first), and saves a write and a read of ``[R, I]``. The backward walks 128-row blocks
of each expert (the wgrad's tiles), so one program owns a whole block: it reads ``h`` and ``da`` once
and writes all three outputs. The forward's padding rows are left unwritten (no GEMM tile reads
them); the backward's programs also zero the padding rows of ``dh`` and ``d_w`` (128 a program), which
are gradients a caller sees: no memset or zeroing launch beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.padding import zero_rows
from megamoe.backends.triton.swiglu import swiglu_backward_tile, swiglu_tile
from megamoe.backends.triton_fp8.fp8_math import TILE, quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_fp8.quantize import empty_rows, empty_segments, row_block
from megamoe.backends.triton_mx.mx_math import segment_of_block
from megamoe.quant.fp8 import FP8Tensor


@triton.jit
def _swiglu_quant_kernel(
    h_ptr,
    data_ptr,
    scale_ptr,
    valid_ptr,
    I,
    stride_scale_r,
    stride_scale_k,
    BLOCK_R: tl.constexpr,
    TILES: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.load(valid_ptr)
    cols = tl.program_id(1) * (TILES * 128) + tl.arange(0, TILES * 128)
    mask = row_ok[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elements, scales = quantize_along_cols(swiglu_tile(gate, up), TILES)
    tl.store(data_ptr + rows64 * I + cols[None, :], elements.to(tl.uint8), mask=mask)
    tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)
    scale_ptrs = scale_ptr + rows64 * stride_scale_r + tiles[None, :].to(tl.int64) * stride_scale_k
    tl.store(scale_ptrs, scales, mask=row_ok[:, None] & (tiles * 128 < I)[None, :])


@triton.jit
def _swiglu_backward_kernel(
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
):
    block = tl.program_id(0)
    g, first_block = segment_of_block(block_start_ptr, block, G, BINS)
    if g < G:
        lanes = tl.arange(0, 128)
        rows = tl.load(row_start_ptr + g) + (block - first_block) * 128 + lanes
        live = rows < tl.load(row_start_ptr + g + 1)
        rows64 = rows.to(tl.int64)[:, None]
        weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
        dot = tl.zeros((128,), dtype=tl.float32)
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
            elements, scales = quantize_along_rows(act * weight[:, None])
            aw_ptrs = aw_data_ptr + cols[:, None].to(tl.int64) * stride_aw + block * 128 + lanes[None, :]
            tl.store(aw_ptrs, tl.trans(elements).to(tl.uint8), mask=col_ok[:, None] & (lanes < 128)[None, :])
            scale_ptrs = aw_scale_ptr + cols.to(tl.int64) * stride_aw_scale_x + block * stride_aw_scale_b
            tl.store(scale_ptrs, scales, mask=col_ok)
        tl.store(d_weight_ptr + rows, dot, mask=live)
    # padding rows (dropped slots): program b zeroes [valid + 128 b, valid + 128 (b + 1)); the grid has
    # at least ceil(R / 128) programs
    pad0 = tl.load(row_start_ptr + G) + block * 128
    if pad0 < R:
        pad = pad0 + tl.arange(0, 128)
        zero_rows(dh_ptr, pad, pad < R, 2 * I, 128, BLOCK_I)
        tl.store(d_weight_ptr + pad, tl.zeros((128,), dtype=d_weight_ptr.dtype.element_ty), mask=pad < R)


def swiglu_quant(h_R2I: Tensor, valid_rows_1: Tensor) -> FP8Tensor:
    """``t(silu(gate) * up)`` in 1×128 tiles along I, ``[R, I]``; padding rows unwritten."""
    R, I = h_R2I.shape[0], h_R2I.shape[1] // 2
    out = empty_rows(R, I, h_R2I.device)
    if R == 0 or I == 0:
        return out
    block_r, tiles = row_block(I, h_R2I.device)
    _swiglu_quant_kernel[(cdiv(R, block_r), cdiv(I, tiles * TILE))](
        h_R2I,
        out.data.view(torch.uint8),
        out.scale,
        valid_rows_1,
        I,
        out.scale.stride(0),
        out.scale.stride(1),
        BLOCK_R=block_r,
        TILES=tiles,
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
    _swiglu_backward_kernel[(num_blocks,)](
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
        num_warps=8 if cuda else 1,
    )
    return aw
