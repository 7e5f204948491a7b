"""Compile the blockwise-FP8 Triton kernels (``megamoe.backends.triton_fp8``) for sm_90a on the CPU (no
GPU) at the launches the CUDA path makes, and print a JSON report: whether each compiled, its shared
memory, and ptxas's registers and spills.

Run in a process without ``TRITON_INTERPRET``, from the repository root:
``python -m tests.megamoe.triton_fp8.sm90_compile``. Launches are described as in
``tests/megamoe/triton/sm90_compile.py`` (whose compiler it uses): DeepSeek-V3's per-rank bench shape,
tiles from ``triton_fp8.configs`` for a CUDA device, scale views with the strides the producers
allocate (a unit stride is a constexpr at launch).
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.experimental.gluon import language as gl

from megamoe.backends.triton.rows_quant import quantize_rows_kernel
from megamoe.backends.triton.segments import quantize_segments_kernel
from megamoe.backends.triton.swiglu_quant import swiglu_backward_quant_kernel, swiglu_quant_kernel
from megamoe.backends.triton_fp8 import wgmma_gemm, wgmma_wgrad
from megamoe.backends.triton_fp8.configs import GPU_WGMMA, GPU_WGMMA_WGRAD, gemm_config, wgrad_config
from megamoe.backends.triton_fp8.fp8_math import TILE, quantize_along_cols, quantize_along_rows
from megamoe.backends.triton_fp8.grouped_gemm import _fp8_grouped_gemm_kernel
from megamoe.backends.triton_fp8.quantize import _quantize_blocks_kernel, row_block
from megamoe.backends.triton_fp8.wgrad import _fp8_wgrad_kernel
from tests.megamoe.triton.sm90_compile import CUDA, NUM_SMS, G, H, I, R, T, config_constexprs, report

NUM_BLOCKS = -(-R // TILE) + G  # FP8Experts.row_plan: 128-row block slots along R
BINS = triton.next_power_of_2(G)


def _gemm(*, gather: bool, rows: int, N: int, K: int, out: str) -> tuple:
    """grouped_gemm.fp8_grouped_gemm: A from quantize_rows / swiglu_quant (scales ``[KB, rows]`` storage),
    B from the weight cache (scales ``[G, N / 128, K / 128]`` contiguous)."""
    cfg = gemm_config(CUDA, gather=gather)
    bm, bn = cfg.block_m, cfg.block_n
    kb, nb = -(-K // TILE), -(-N // TILE)
    args = dict(
        a_ptr="*fp8e4nv", a_desc=None if gather else f"tensordesc<fp8e4nv[{bm},{TILE}]>", a_scale_ptr="*fp32",
        a_rows_ptr="*i32" if gather else None, b_desc=f"tensordesc<fp8e4nv[1,{bn},{TILE}]>",
        b_scale_ptr="*fp32", c_ptr=out, tiles_ptr="*i32", num_tiles_ptr="*i32", N=N, K=K, stride_a=K,
        stride_as_r=1, stride_as_k=rows, stride_bs_g=nb * kb, stride_bs_n=kb, stride_bs_k=1, stride_c=N,
        num_programs=NUM_SMS * cfg.programs_per_sm, A_GATHER=gather,
        **config_constexprs(_fp8_grouped_gemm_kernel, cfg),
    )  # fmt: skip
    return _fp8_grouped_gemm_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _wgmma_gemm(*, N: int, K: int, out: str, b_rows: int | None = None) -> tuple:
    """wgmma_gemm.wgmma_fp8_grouped_gemm: A ``[R, K]`` gathered or quantised in row order (scales
    ``[KB, R]`` storage), B viewed as rows of K, an expert's every ``b_rows`` (N: the whole weight), both
    with the kernel's NVMMA shared layouts (B in a wide and a narrow piece)."""
    cfg = GPU_WGMMA
    kb, nb = -(-K // TILE), -(-N // TILE)
    output = torch.empty(0, dtype={"*bf16": torch.bfloat16, "*fp32": torch.float32}[out])
    args = dict(
        a_desc=_desc(TILE), bw_desc=_desc(wgmma_gemm.WIDE.value), bn_desc=_desc(wgmma_gemm.NARROW.value),
        a_scale_ptr="*fp32", b_scale_ptr="*fp32", c_ptr=out, cw_desc=_out_desc(wgmma_gemm.WIDE.value, out),
        cn_desc=_out_desc(wgmma_gemm.NARROW.value, out), tiles_ptr="*i32", num_tiles_ptr="*i32", N=N, K=K,
        b_rows=b_rows or N, stride_as_r=1, stride_as_k=R, stride_bs_g=nb * kb, stride_bs_n=kb, stride_bs_k=1,
        stride_c=N, num_programs=NUM_SMS * cfg.programs_per_sm, GROUP_M=cfg.group_m,
        STAGES=wgmma_gemm._stages(cfg, output), STAGED=wgmma_gemm._staged(output),
        CONSUMER_REGS=wgmma_gemm.CONSUMER_REGS,
    )  # fmt: skip
    return wgmma_gemm._wgmma_fp8_gemm_kernel, args, {"num_warps": cfg.num_warps}


def _desc(rows: int) -> str:
    """The type of a TMA descriptor of ``rows x 128`` E4M3 boxes in the shared layout the MMA reads."""
    layout = repr(gl.NVMMASharedLayout.get_default_for([rows, TILE], gl.float8e4nv))
    return f"tensordesc<fp8e4nv[{rows},{TILE}],{layout}>"


def _out_desc(cols: int, out: str) -> str:
    """The type of a TMA descriptor of ``64 x cols`` boxes of an output of pointer type ``out``, in the
    layout of the kernels' staging buffers."""
    dtype = out.lstrip("*")
    gl_dtype = {"bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
    layout = repr(gl.NVMMASharedLayout.get_default_for([64, cols], gl_dtype))
    return f"tensordesc<{dtype}[64,{cols}],{layout}>"


def _wgrad(M: int, N: int) -> tuple:
    """wgrad.fp8_wgrad: packed along-R operands ``[M|N, 128 NB]``, scales ``[NB, M|N]`` storage."""
    cfg = wgrad_config(CUDA)
    args = dict(
        p_desc=f"tensordesc<fp8e4nv[{cfg.block_m},{TILE}]>", q_desc=f"tensordesc<fp8e4nv[{cfg.block_n},{TILE}]>",
        p_scale_ptr="*fp32", q_scale_ptr="*fp32", out_ptr="*bf16", block_start_ptr="*i32", G=G, M=M, N=N,
        stride_ps_m=1, stride_ps_b=M, stride_qs_n=1, stride_qs_b=N, stride_out_g=M * N, stride_out_m=N,
        num_programs=NUM_SMS * cfg.programs_per_sm, **config_constexprs(_fp8_wgrad_kernel, cfg),
    )  # fmt: skip
    return _fp8_wgrad_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _wgmma_wgrad(M: int, N: int) -> tuple:
    """wgmma_wgrad.wgmma_fp8_wgrad: packed along-R operands with the kernel's NVMMA shared layouts."""
    cfg = GPU_WGMMA_WGRAD
    args = dict(
        p_desc=_desc(TILE), q_desc=_desc(cfg.block_n), p_scale_ptr="*fp32", q_scale_ptr="*fp32",
        out_ptr="*bf16", out_desc=_out_desc(cfg.block_n, "*bf16"), block_start_ptr="*i32", G=G, M=M, N=N,
        stride_ps_m=1, stride_ps_b=M, stride_qs_n=1,
        stride_qs_b=N, stride_out_g=M * N, stride_out_m=N, num_programs=NUM_SMS * cfg.programs_per_sm,
        BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, CONSUMER_REGS=wgmma_wgrad.CONSUMER_REGS,
    )  # fmt: skip
    return wgmma_wgrad._wgmma_fp8_wgrad_kernel, args, {"num_warps": cfg.num_warps}


def _quantize_rows(rows: int, X: int, *, valid: bool) -> tuple:
    block_r, tiles = row_block(X, CUDA)
    args = dict(
        src_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", valid_rows_ptr="*i32" if valid else None, R=rows,
        X=X, stride_src=X, stride_data=X, stride_scale_r=1, stride_scale_k=rows, HAS_VALID=valid, BLOCK_R=block_r,
        BLOCK_X=tiles * TILE, TILE=TILE, QUANTIZE_ALONG_COLS=quantize_along_cols,
    )  # fmt: skip
    return quantize_rows_kernel, args, {"num_warps": 4}


def _quantize_segments(*, index: bool, X: int) -> tuple:
    args = dict(
        src_ptr="*bf16", index_ptr="*i32" if index else None, row_start_ptr="*i32", block_start_ptr="*i32",
        data_ptr="*u8", scale_ptr="*fp32", G=G, X=X, stride_src=X, data_seg=0, data_x=NUM_BLOCKS * TILE,
        scale_seg=0, scale_x=1, scale_b=X, HAS_INDEX=index, PACKED=True, WHOLE_BLOCKS=False, BINS=BINS,
        BLOCK_X=min(triton.next_power_of_2(X), 32), TILE=TILE, QUANTIZE_ALONG_ROWS=quantize_along_rows,
    )  # fmt: skip
    return quantize_segments_kernel, args, {"num_warps": 4}


def _quantize_blocks(Y: int, X: int, *, transposed: bool = False, both: bool = False) -> tuple:
    """quantize.quantize_weight from ``w [G, Y, X]`` or its transposed view (unit stride along Y), or
    quantize_weight_both (``w`` and ``w^T`` from ``w``)."""
    strides = (
        dict(stride_g=X * Y, stride_y=1, stride_x=Y)
        if transposed
        else dict(stride_g=X * Y, stride_y=X, stride_x=1)
    )
    args = dict(
        src_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", data_t_ptr="*u8", scale_t_ptr="*fp32", Y=Y, X=X,
        **strides, BOTH=both,
    )  # fmt: skip
    return _quantize_blocks_kernel, args, {"num_warps": 16}


def _swiglu() -> dict:
    block_r, tiles = row_block(I, CUDA)
    forward = dict(
        h_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", valid_ptr="*i32", I=I, stride_scale_r=1,
        stride_scale_k=R, BLOCK_R=block_r, TILES=tiles, TILE=TILE, QUANTIZE_ALONG_COLS=quantize_along_cols,
    )  # fmt: skip
    backward = dict(
        h_ptr="*bf16", da_ptr="*fp32", weight_ptr="*fp32", dh_ptr="*bf16", d_weight_ptr="*fp32",
        aw_data_ptr="*u8", aw_scale_ptr="*fp32", row_start_ptr="*i32", block_start_ptr="*i32", R=R, G=G, I=I,
        stride_aw=NUM_BLOCKS * TILE, stride_aw_scale_x=1, stride_aw_scale_b=I, BINS=BINS, BLOCK_I=32, TILE=TILE,
        QUANTIZE_ALONG_ROWS=quantize_along_rows,
    )  # fmt: skip
    return {
        "swiglu + quantize rows (fc2 A)": (swiglu_quant_kernel, forward, {"num_warps": 4}),
        "swiglu backward + quantize along R (dW2 Q)": (
            swiglu_backward_quant_kernel,
            backward,
            {"num_warps": 8},
        ),
    }


LAUNCHES = {
    "gemm: row gather, bf16 out (fc1 fwd)": _gemm(gather=True, rows=T, N=2 * I, K=H, out="*bf16"),
    "gemm: row gather, fp32 out (fc2 dgrad)": _gemm(gather=True, rows=T, N=I, K=H, out="*fp32"),
    "gemm: A by TMA, bf16 out (fc2 fwd, fc1 dgrad)": _gemm(gather=False, rows=R, N=H, K=I, out="*bf16"),
    "wgmma gemm, bf16 out (fc1 fwd)": _wgmma_gemm(N=2 * I, K=H, out="*bf16"),
    "wgmma gemm, fp32 out (fc2 dgrad)": _wgmma_gemm(N=I, K=H, out="*fp32"),
    "wgmma gemm, bf16 out (fc2 fwd)": _wgmma_gemm(N=H, K=I, out="*bf16"),
    "wgmma gemm, bf16 out (fc1 dgrad)": _wgmma_gemm(N=H, K=2 * I, out="*bf16"),
    "wgmma gemm, bf16 out (fc1 dgrad, half its columns)": _wgmma_gemm(
        N=H // 2, K=2 * I, out="*bf16", b_rows=H
    ),
    "wgrad (K-grouped)": _wgrad(H, I),
    "wgmma wgrad (dW1)": _wgmma_wgrad(2 * I, H),
    "wgmma wgrad (dW2)": _wgmma_wgrad(H, I),
    "quantize rows (x, dy)": _quantize_rows(T, H, valid=False),
    "quantize rows, valid rows (dh)": _quantize_rows(R, 2 * I, valid=True),
    "quantize segments: gathered (x, dy)": _quantize_segments(index=True, X=H),
    "quantize segments (dh)": _quantize_segments(index=False, X=2 * I),
    "quantize weight blocks": _quantize_blocks(2 * I, H, transposed=False),
    "quantize weight blocks, transposed view": _quantize_blocks(2 * I, H, transposed=True),
    "quantize weight blocks, both forms": _quantize_blocks(2 * I, H, both=True),
    **_swiglu(),
}


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
