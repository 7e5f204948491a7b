"""SwiGLU passes of the MXFP8 path, each emitting the MX operand of the next GEMM (fused quantisation).

Legend: R rows (expert-sorted; rows ``>= valid`` are padding), I intermediate, h = [gate | up] ``[R, 2I]``,
``w_r`` the routing weight of row r, NB block slots of 32 rows (each inside one expert's rows).

    forward:  a = silu(gate) * up (fp32)  ->  q(a) rowwise along I          (fc2's A operand)
    backward: da = dy W2 (fp32, without w_r) and h  ->
              dh = swiglu'(h) (w_r da)                                       (bf16, to stage 1)
              d_w[r] = <da[r], a[r]>                                         (fp32, unquantised a)
              q(w a) along R per expert, transposed [I, 32 NB]               (dW2's Q operand)

Quantising from the fp32 values in registers is what the emulation does (it never rounds ``a`` or
``w a`` to bf16 first), and saves a write and a read of ``[R, I]``. The backward walks 32-row blocks
of each expert (the wgrad's MX blocks), so one program owns a whole block column: it reads ``h`` and
``da`` once and writes all three outputs. The forward's padding rows are left unwritten (no GEMM tile
reads them); the backward's ``dh`` and ``d_w`` padding rows are the caller's to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.swiglu import swiglu_backward_tile, swiglu_tile
from megamoe.backends.triton_mx.mx_math import quantize_along_cols, quantize_along_rows, segment_of_block
from megamoe.backends.triton_mx.quantize_rows import empty_rows_mx
from megamoe.quant.mx import BLOCK, MXTensor


@triton.jit
def _swiglu_quant_kernel(
    h_ptr,
    data_ptr,
    scale_ptr,
    valid_ptr,
    I,
    stride_scale_r,
    stride_scale_b,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.load(valid_ptr)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = row_ok[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elements, codes = quantize_along_cols(swiglu_tile(gate, up), BLOCK_I // 32)
    tl.store(data_ptr + rows64 * I + cols[None, :], elements.to(tl.uint8), mask=mask)
    blocks = tl.program_id(1) * (BLOCK_I // 32) + tl.arange(0, BLOCK_I // 32)
    scale_ptrs = scale_ptr + rows64 * stride_scale_r + blocks[None, :].to(tl.int64) * stride_scale_b
    tl.store(scale_ptrs, codes.to(tl.uint8), mask=row_ok[:, None] & (blocks * 32 < I)[None, :])


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
    G,
    I,
    aw_data_x,
    aw_scale_x,
    aw_scale_b,
    BINS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    block = tl.program_id(0)
    g, first_block = segment_of_block(block_start_ptr, block, G, BINS)
    if g < G:
        lanes = tl.arange(0, 32)
        rows = tl.load(row_start_ptr + g) + (block - first_block) * 32 + lanes
        live = rows < tl.load(row_start_ptr + g + 1)
        rows64 = rows.to(tl.int64)[:, None]
        weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
        dot = tl.zeros((32,), dtype=tl.float32)
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
            elements, codes = quantize_along_rows(act * weight[:, None])
            aw_ptrs = aw_data_ptr + cols[:, None].to(tl.int64) * aw_data_x + block * 32 + lanes[None, :]
            tl.store(aw_ptrs, tl.trans(elements).to(tl.uint8), mask=col_ok[:, None] & (lanes < 32)[None, :])
            scale_ptrs = aw_scale_ptr + cols.to(tl.int64) * aw_scale_x + block * aw_scale_b
            tl.store(scale_ptrs, codes.to(tl.uint8), mask=col_ok)
        tl.store(d_weight_ptr + rows, dot, mask=live)


def swiglu_quant(h_R2I: Tensor, valid_rows_1: Tensor) -> MXTensor:
    """``q(silu(gate) * up)`` rowwise along I, ``[R, I]`` (codes block-major); padding rows unwritten."""
    R, I = h_R2I.shape[0], h_R2I.shape[1] // 2
    out = empty_rows_mx(R, I, h_R2I.device)
    if R == 0 or I == 0:
        return out
    interpret = h_R2I.device.type != "cuda"
    block_i = min(next_power_of_2(max(I, BLOCK)), 64 if interpret else 256)
    block_r = 8 if interpret else max(1, 4096 // block_i)
    _swiglu_quant_kernel[(cdiv(R, block_r), cdiv(I, block_i))](
        h_R2I,
        out.data.view(torch.uint8),
        out.scale,
        valid_rows_1,
        I,
        out.scale.stride(0),
        out.scale.stride(1),
        BLOCK_R=block_r,
        BLOCK_I=block_i,
        num_warps=1 if interpret else 4,
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
) -> MXTensor:
    """Write ``dh`` and ``d_weight`` (fp32) on the routed rows; return ``q(w a)`` along R, packed
    ``[I, 32 num_blocks]`` like :func:`~megamoe.backends.triton_mx.quantize_segments.quantize_segments`."""
    R, I = da_RI.shape
    G = row_start_G1.shape[0] - 1
    aw = MXTensor(
        data=torch.empty(I, num_blocks * BLOCK, dtype=torch.float8_e4m3fn, device=h_R2I.device),
        scale=torch.empty(num_blocks, I, dtype=torch.uint8, device=h_R2I.device).t(),
        dim=1,
    )
    if R == 0 or I == 0 or G == 0:
        return aw
    interpret = h_R2I.device.type != "cuda"
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
        G,
        I,
        aw.data.stride(0),
        aw.scale.stride(0),
        aw.scale.stride(1),
        BINS=next_power_of_2(G),
        BLOCK_I=min(next_power_of_2(max(I, BLOCK)), 32 if interpret else 128),
        num_warps=1 if interpret else 4,
    )
    return aw
