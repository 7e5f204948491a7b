"""Persistent M-grouped MXFP8 GEMM over expert-sorted rows: ``C[r] = A[r] @ B[expert(r)]^T``.

Legend: R rows (expert-sorted), G local experts, N output columns, K reduction, KB = ceil(K / 32).
A ``[rows, K]`` and B ``[G, N, K]`` are E4M3 with one E8M0 code per 32 along K (``sa [rows, KB]``,
``sb [G, N, KB]``, any strides). Same schedule as :mod:`megamoe.backends.triton.grouped_gemm`
(device tile table, persistent grid, GROUP_M swizzle, rows never padded in memory)::

    for tile in range(program_id, num_m_tiles * num_n_tiles, num_programs):
        expert, r0, r_end = tiles[m_tile]
        for kb in range(KB):                                   # SUB of them per pipeline stage
            A_GATHER: a = A[rows[r0:r0+BM], 32kb:32kb+32], sa[rows[...], kb]   # fused dispatch
            else:     a = A[r0:r0+BM, 32kb:32kb+32] (TMA),  sa[r0:r0+BM, kb]
            b = B[expert, n:n+BN, 32kb:32kb+32] (TMA), sb[expert, n:n+BN, kb]
            acc += dot_e4m3(a, b^T) * (2**(sa-127)[:, None] * 2**(sb-127)[None, :])   # fp32
        C[r0:r_end, n:n+BN] = acc

Each 32-deep MMA (Hopper ``wgmma`` k=32 for E4M3) starts from zero and its fp32 result is scaled and
added on the CUDA cores: that is where the per-32 scales enter, and it also promotes Hopper's reduced-
precision FP8 accumulation to fp32 after every block. It costs one multiply and one FMA per output
element per 32 of K, which on Hopper is about what the tensor core spends on the MMA itself (see
docs/mxfp8.md). A short last K block reads zeros (TMA zero-fill, masked gather). A masked row's codes
read as 127 (scale 1), so nothing NaN enters from outside the tile.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton_mx.mx_math import e8m0_to_float, swizzle
from megamoe.quant.mx import BLOCK, MXTensor


@triton.jit
def _mx_grouped_gemm_kernel(
    # pointers / descriptors
    a_ptr,
    a_desc,
    a_scale_ptr,
    a_rows_ptr,
    b_desc,
    b_scale_ptr,
    c_ptr,
    tiles_ptr,
    num_tiles_ptr,
    # sizes and strides
    N,
    K,
    stride_a,
    stride_as_r,
    stride_as_k,
    stride_bs_g,
    stride_bs_n,
    stride_bs_k,
    stride_c,
    num_programs,
    # meta-parameters
    A_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_m = tl.load(num_tiles_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    num_kb = tl.cdiv(K, 32)
    offs_k = tl.arange(0, 32)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = swizzle(tile_id, num_m, num_n, GROUP_M)
        expert = tl.load(tiles_ptr + 3 * pid_m)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        n0 = pid_n * BLOCK_N
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < r_end
        if A_GATHER:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        else:
            a_rows = offs_m.to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
        sa_ptrs = a_scale_ptr + a_rows * stride_as_r
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        sb_ptrs = b_scale_ptr + expert.to(tl.int64) * stride_bs_g + offs_n.to(tl.int64) * stride_bs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(num_kb, SUB)):
            for j in tl.static_range(SUB):
                kb = kk * SUB + j
                k0 = kb * 32
                if A_GATHER:
                    a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & (offs_k < K - k0)[None, :], other=0.0)
                else:
                    a = a_desc.load([r0, k0])
                b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, 32)
                sa = tl.load(sa_ptrs + kb * stride_as_k, mask=mask_m & (kb < num_kb), other=127)
                sb = tl.load(sb_ptrs + kb * stride_bs_k, mask=mask_n & (kb < num_kb), other=127)
                part = tl.dot(a, b.T, out_dtype=tl.float32)
                acc += part * (e8m0_to_float(sa)[:, None] * e8m0_to_float(sb)[None, :])
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def mx_grouped_gemm(
    a: MXTensor,
    b: MXTensor,
    out: Tensor,
    plan: RoutingPlan,
    *,
    config: dict,
    num_sms: int,
    a_rows: Tensor | None = None,
) -> None:
    """Write ``out [R, N]`` (rows of the plan's tiles only) from MX ``a`` and ``b [G, N, K]``.

    ``a`` is ``[R, K]`` expert-sorted, or ``[T, K]`` read through ``a_rows [R]`` (the fused dispatch).
    Both are blocked along K (their last dim) and their data contiguous; K must be a multiple of 16
    (TMA's 16-byte row stride for E4M3).
    """
    bm, bn, sub = config["BLOCK_M"], config["BLOCK_N"], config["SUB"]
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    _, N, K = b.data.shape
    if a.data.shape[1] != K or a.dim != 1 or b.dim != 2:
        raise ValueError(
            f"a {tuple(a.data.shape)} and b {tuple(b.data.shape)}: expected [*, K] and [G, N, K] blocked along K"
        )
    if K % 16:
        raise ValueError(f"K={K}: must be a multiple of 16 (E4M3 rows by TMA)")
    if a.scale.shape[1] != -(-K // BLOCK) or b.scale.shape[2] != -(-K // BLOCK):
        raise ValueError("scales: expected ceil(K / 32) codes per row")
    b_desc = TensorDescriptor.from_tensor(b.data, [1, bn, BLOCK])
    a_desc = TensorDescriptor.from_tensor(a.data, [bm, BLOCK]) if a_rows is None else None
    grid_size = max(1, min(num_sms, plan.max_tiles * triton.cdiv(N, bn)))
    _mx_grouped_gemm_kernel[(grid_size,)](
        a.data,
        a_desc,
        a.scale,
        a_rows,
        b_desc,
        b.scale,
        out,
        plan.tiles_X3,
        plan.num_tiles_1,
        N,
        K,
        a.data.stride(0),
        a.scale.stride(0),
        a.scale.stride(1),
        b.scale.stride(0),
        b.scale.stride(1),
        b.scale.stride(2),
        out.stride(0),
        grid_size,
        A_GATHER=a_rows is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        SUB=sub,
        GROUP_M=config.get("GROUP_M", 8),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
