"""SwiGLU forward and backward over expert-sorted rows, each one pass over memory.

Legend: R rows (expert-sorted; rows ``>= valid`` are padding), I intermediate, h = [gate | up] ``[R, 2I]``.

    forward:  a[r] = silu(gate[r]) * up[r]                                        (valid rows only)
    backward: given da[r] = dL/d(w_r a_r) W2-side gradient without the routing weight w_r,
              d_w[r]   = <da[r], a[r]>                       (the routing-weight gradient, fp32 sum)
              d_gate   = w_r da * up * s * (1 + gate (1 - s)),  d_up = w_r da * silu(gate)
              aw[r]    = w_r a[r]                            (the operand of dW2)
              padding rows: dh = 0, d_w = 0

The forward also runs in GEMM1's epilogue (grouped_gemm.py), through :func:`swiglu_tile`, the one
formula both use, so the two give the same bits; this pass serves the fused EP kernels
(``backends/symm``) and a stage 2 handed an ``h`` without its activation. Why the backward and GEMM2's
side are not fused: computing SwiGLU in GEMM2's operand load (A from registers, instead of a TMA-fed
A) and the SwiGLU-backward epilogue on GEMM2-dgrad (four live [128, 128] fp32 tiles) each slow that
GEMM by far more than one extra pass over ``[R, 2I]`` costs (measured in
docs/kernels.md#measurements-that-chose-the-design).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2


@triton.jit
def swiglu_tile(gate, up):
    """``silu(gate) * up`` in fp32 from tiles of h's dtype: the one formula of this pass and of
    GEMM1's epilogue (grouped_gemm.py), so both give the same bits."""
    gate = gate.to(tl.float32)
    return gate * tl.sigmoid(gate) * up.to(tl.float32)


@triton.jit
def swiglu_backward_tile(gate, up, da, weight):
    """From fp32 tiles of gate, up, ``da`` and the rows' routing ``weight [rows]``: ``(act, d_gate, d_up)``
    of ``a = silu(gate) * up`` with the output scaled by the weight (the one formula of the bf16 and
    MXFP8 backward passes)."""
    sig = tl.sigmoid(gate)
    silu = gate * sig
    grad = da * weight[:, None]
    return silu * up, grad * up * sig * (1.0 + gate * (1.0 - sig)), grad * silu


@triton.jit
def _swiglu_forward_kernel(h_ptr, a_ptr, valid_ptr, I, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    valid = tl.load(valid_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < valid)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0)
    up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0)
    act = swiglu_tile(gate, up)
    tl.store(a_ptr + rows64 * I + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    h_ptr,
    da_ptr,
    weight_ptr,
    dh_ptr,
    aw_ptr,
    d_weight_ptr,
    valid_ptr,
    R,
    I,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    valid = tl.load(valid_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < R
    live = rows < valid
    rows64 = rows.to(tl.int64)[:, None]
    weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        col_ok = (cols < I)[None, :]
        mask = live[:, None] & col_ok
        gate = tl.load(h_ptr + rows64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + rows64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows64 * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        act, d_gate, d_up = swiglu_backward_tile(gate, up, da, weight)
        dot += tl.sum(da * act, axis=1)
        out_mask = in_range[:, None] & col_ok
        dh_row = dh_ptr + rows64 * (2 * I) + cols[None, :]
        tl.store(dh_row, d_gate.to(dh_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dh_row + I, d_up.to(dh_ptr.dtype.element_ty), mask=out_mask)
        tl.store(
            aw_ptr + rows64 * I + cols[None, :],
            (act * weight[:, None]).to(aw_ptr.dtype.element_ty),
            mask=mask,
        )
    tl.store(d_weight_ptr + rows, dot.to(d_weight_ptr.dtype.element_ty), mask=in_range)


def _blocks(I: int, interpret: bool) -> tuple[int, int]:
    block_i = min(next_power_of_2(I), 16 if interpret else 256)
    return (4 if interpret else max(1, 4096 // block_i)), block_i


def swiglu_forward(h_R2I: Tensor, a_RI: Tensor, valid_rows_1: Tensor) -> None:
    """Write ``a = silu(gate) * up`` for the valid rows (padding rows of ``a`` are left untouched)."""
    R, I = a_RI.shape
    block_r, block_i = _blocks(I, h_R2I.device.type != "cuda")
    _swiglu_forward_kernel[(cdiv(R, block_r), cdiv(I, block_i))](
        h_R2I, a_RI, valid_rows_1, I, BLOCK_R=block_r, BLOCK_I=block_i
    )


def swiglu_backward(
    h_R2I: Tensor,
    da_RI: Tensor,
    weight_R: Tensor,
    dh_R2I: Tensor,
    aw_RI: Tensor,
    d_weight_R: Tensor,
    valid_rows_1: Tensor,
) -> None:
    """Write ``dh``, ``aw = w * a`` and ``d_weight = <da, a>`` (zeros on padding rows of dh and d_weight)."""
    R, I = da_RI.shape
    block_r, block_i = _blocks(I, h_R2I.device.type != "cuda")
    block_r = min(block_r, 16) if h_R2I.device.type == "cuda" else block_r
    _swiglu_backward_kernel[(cdiv(R, block_r),)](
        h_R2I,
        da_RI,
        weight_R,
        dh_R2I,
        aw_RI,
        d_weight_R,
        valid_rows_1,
        R,
        I,
        BLOCK_R=block_r,
        BLOCK_I=block_i,
    )
