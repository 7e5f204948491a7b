"""Compile the MXFP8 Triton kernels (``megamoe.backends.triton_mx``) for sm_90a on the CPU (no GPU) at
the launches the CUDA path makes, and print a JSON report: whether each compiled, its shared memory,
and ptxas's registers and spills.

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` kernels, which
then cannot be compiled), from the repository root: ``python -m tests.megamoe.triton_mx.sm90_compile``.
Launches are described as in ``tests/megamoe/triton/sm90_compile.py`` (whose compiler it uses):
DeepSeek-V3's per-rank bench shape, tiles from ``triton_mx.configs`` for a CUDA device
(``programs_per_sm`` only sizes the grid), scale views with the strides the producers allocate (a
unit stride is a constexpr at launch). The routing, padding and combine kernels this backend shares
are compiled by the bf16 script.
"""

from __future__ import annotations

import json
import sys

import triton

from megamoe.backends.triton.rows_quant import quantize_rows_kernel
from megamoe.backends.triton.segments import quantize_segments_kernel
from megamoe.backends.triton.swiglu_quant import swiglu_backward_quant_kernel, swiglu_quant_kernel
from megamoe.backends.triton_mx.configs import WGRAD_BLOCK_ALIGN, gemm_config, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import _mx_grouped_gemm_kernel
from megamoe.backends.triton_mx.mx_math import quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_mx.wgrad import _mx_wgrad_kernel
from megamoe.quant.mx import BLOCK
from tests.megamoe.triton.sm90_compile import CUDA, NUM_SMS, G, H, I, R, T, config_constexprs, report

NUM_BLOCKS = -(-R // BLOCK) + G * WGRAD_BLOCK_ALIGN  # MXPlan.num_blocks: block slots along R
BINS = triton.next_power_of_2(G)  # quantize_segments._launch, swiglu_backward_quant


def _gemm(*, gather: bool, rows: int, N: int, K: int, out: str, remote: str = "") -> tuple:
    """grouped_gemm.mx_grouped_gemm: A from quantize_rows/swiglu_quant (codes block-major: ``[KB, rows]``
    storage behind the ``[rows, KB]`` view), B from the weight cache (codes ``[KB, G, N]`` storage).
    ``remote`` (EP over symmetric memory): ``"scale"`` rows times their routing weight, ``"scalar"``
    rows with a scalar, sent to their sources."""
    cfg = gemm_config(CUDA)
    bm, bn = cfg.block_m, cfg.block_n
    args = dict(
        a_ptr="*fp8e4nv", a_desc=None if gather else f"tensordesc<fp8e4nv[{bm},{BLOCK}]>", a_scale_ptr="*u8",
        a_rows_ptr="*i32" if gather else None, b_desc=f"tensordesc<fp8e4nv[1,{bn},{BLOCK}]>",
        b_scale_ptr="*u8", c_ptr=out, tiles_ptr="*i32", num_tiles_ptr="*i32",
        row_scale_ptr="*fp32" if remote == "scale" else None, scalar_ptr="*fp32" if remote == "scalar" else None,
        **dict.fromkeys(("row_src_ptr", "row_pos_ptr", "comb_ready_ptr", "epoch_ptr", "done_ptr"), "*i32" if remote else None),
        comb_scalar_ptr="*fp32" if remote else None, ptrs_dev="i64", rank="i32", world="i32",
        OUT_REMOTE=bool(remote), ROW_SCALE=remote == "scale", PUSH_SCALAR=remote == "scalar", N=N, K=K, stride_a=K,
        stride_as_r=1, stride_as_k=rows, stride_bs_g=N, stride_bs_n=1, stride_bs_k=G * N, stride_c=N,
        num_programs=NUM_SMS * cfg.programs_per_sm, A_GATHER=gather,
        **config_constexprs(_mx_grouped_gemm_kernel, cfg),
    )  # fmt: skip
    return _mx_grouped_gemm_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _wgrad(M: int, N: int) -> tuple:
    """wgrad.mx_wgrad: packed along-R operands ``[M|N, 32 NB]``, codes ``[NB, M|N]`` storage."""
    cfg = wgrad_config(CUDA)
    args = dict(
        p_desc=f"tensordesc<fp8e4nv[{cfg.block_m},{BLOCK}]>",
        q_desc=f"tensordesc<fp8e4nv[{cfg.block_n},{BLOCK}]>", p_scale_ptr="*u8", q_scale_ptr="*u8",
        out_ptr="*bf16", block_start_ptr="*i32", G=G, M=M, N=N, stride_ps_m=1, stride_ps_b=M,
        stride_qs_n=1, stride_qs_b=N, num_programs=NUM_SMS * cfg.programs_per_sm,
        **config_constexprs(_mx_wgrad_kernel, cfg),
    )  # fmt: skip
    return _mx_wgrad_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _quantize_rows(rows: int, X: int, *, valid: bool) -> tuple:
    """quantize_rows.quantize_rows into empty_rows_mx (codes block-major)."""
    block_x = min(triton.next_power_of_2(max(X, BLOCK)), 256)
    args = dict(
        src_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", valid_rows_ptr="*i32" if valid else None, R=rows,
        X=X, stride_src=X, stride_data=X, stride_scale_r=1, stride_scale_k=rows, HAS_VALID=valid,
        BLOCK_R=max(1, 4096 // block_x), BLOCK_X=block_x, TILE=BLOCK, QUANTIZE_ALONG_COLS=quantize_along_cols,
    )  # fmt: skip
    return quantize_rows_kernel, args, {"num_warps": 4}


def _quantize_segments(*, index: bool, packed: bool, X: int, Y: int = 0) -> tuple:
    """quantize_segments._launch: the packed wgrad operand (quantize_segments, rows gathered through
    ``index`` or not) or the weight cache's transposed form (quantize_transposed_weight, ``w [G, Y, X]``)."""
    if packed:
        strides = dict(data_seg=0, data_x=NUM_BLOCKS * BLOCK, scale_seg=0, scale_x=1, scale_b=X)
    else:  # out.data [G, X, Y], out.scale [G, X, B] over [B, G, X] storage (weights.empty_weight_mx)
        strides = dict(data_seg=X * Y, data_x=Y, scale_seg=X, scale_x=1, scale_b=G * X)
    args = dict(
        src_ptr="*bf16", index_ptr="*i32" if index else None, row_start_ptr="*i32", block_start_ptr="*i32",
        data_ptr="*u8", scale_ptr="*u8", G=G, X=X, stride_src=X, **strides, HAS_INDEX=index, PACKED=packed,
        WHOLE_BLOCKS=not packed and Y % BLOCK == 0, BINS=BINS, BLOCK_X=min(triton.next_power_of_2(X), 128),
        TILE=BLOCK, QUANTIZE_ALONG_ROWS=quantize_along_rows,
    )  # fmt: skip
    return quantize_segments_kernel, args, {"num_warps": 4}


def _swiglu() -> dict:
    """swiglu.swiglu_quant (fc2's A, rowwise along I) and swiglu_backward_quant (dh, d_w, q(w a) along R)."""
    block_i = min(triton.next_power_of_2(max(I, BLOCK)), 256)
    forward = dict(
        h_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", valid_ptr="*i32", I=I, stride_scale_r=1,
        stride_scale_k=R, BLOCK_R=max(1, 4096 // block_i), TILES=block_i // BLOCK, TILE=BLOCK,
        QUANTIZE_ALONG_COLS=quantize_along_cols,
    )  # fmt: skip
    backward = dict(
        h_ptr="*bf16", da_ptr="*fp32", weight_ptr="*fp32", dh_ptr="*bf16", d_weight_ptr="*fp32",
        aw_data_ptr="*u8", aw_scale_ptr="*u8", row_start_ptr="*i32", block_start_ptr="*i32", R=R, G=G, I=I,
        stride_aw=NUM_BLOCKS * BLOCK, stride_aw_scale_x=1, stride_aw_scale_b=I, BINS=BINS,
        BLOCK_I=min(triton.next_power_of_2(max(I, BLOCK)), 64), TILE=BLOCK, QUANTIZE_ALONG_ROWS=quantize_along_rows,
    )  # fmt: skip
    return {
        "swiglu + quantize rows (fc2 A)": (swiglu_quant_kernel, forward, {"num_warps": 4}),
        "swiglu backward + quantize along R (dW2 Q)": (
            swiglu_backward_quant_kernel,
            backward,
            {"num_warps": 4},
        ),
    }


LAUNCHES = {
    # stage 1 fwd h = q(x)[row_token] q(W1)^T; stage 2 bwd da (fp32) = q(dy)[row_token] q(W2^T)^T
    "gemm: row gather, bf16 out (fc1 fwd)": _gemm(gather=True, rows=T, N=2 * I, K=H, out="*bf16"),
    "gemm: row gather, fp32 out (fc2 dgrad)": _gemm(gather=True, rows=T, N=I, K=H, out="*fp32"),
    # stage 2 fwd o = q(a) q(W2)^T; stage 1 bwd dx rows = q(dh) q(W1^T)^T (same specialisation)
    "gemm: A by TMA, bf16 out (fc2 fwd, fc1 dgrad)": _gemm(gather=False, rows=R, N=H, K=I, out="*bf16"),
    # EP over symmetric memory: stage 2 fwd rows * weight, stage 1 bwd dx rows + d(weight) to their sources
    "gemm: A by TMA, rows * weight to sources (EP fc2 fwd)": _gemm(
        gather=False, rows=R, N=H, K=I, out="*bf16", remote="scale"
    ),
    "gemm: A by TMA, rows + scalar to sources (EP fc1 dgrad)": _gemm(
        gather=False, rows=R, N=H, K=2 * I, out="*bf16", remote="scalar"
    ),
    "wgrad (K-grouped)": _wgrad(H, I),
    "quantize rows (x, dy, weights)": _quantize_rows(T, H, valid=False),
    "quantize rows, valid rows (dh)": _quantize_rows(R, 2 * I, valid=True),
    "quantize segments: packed, gathered (x, dy)": _quantize_segments(index=True, packed=True, X=H),
    "quantize segments: packed (dh)": _quantize_segments(index=False, packed=True, X=2 * I),
    "quantize segments: transposed weight": _quantize_segments(index=False, packed=False, X=H, Y=2 * I),
    **_swiglu(),
}


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
