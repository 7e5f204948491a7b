"""Persistent M-grouped blockwise-FP8 GEMM over expert-sorted rows: ``C[r] = A[r] @ B[expert(r)]^T``.

Legend: R rows (expert-sorted), G local experts, N output columns, K reduction, KB = ceil(K / 128).
A ``[rows, K]`` is E4M3 in 1×128 tiles (scales ``sa [rows, KB]``), B ``[G, N, K]`` E4M3 in 128×128
blocks (scales ``sb [G, ceil(N / 128), KB]``, any strides: the dgrad reads ``W^T``'s scales through
the transposed view of ``W``'s). Same schedule as :mod:`megamoe.backends.triton.grouped_gemm` (device
tile table, persistent grid, GROUP_M swizzle, rows never padded in memory)::

    for tile in range(program_id, num_m_tiles * num_n_tiles, num_programs):
        expert, r0, r_end = tiles[m_tile]
        for kb in range(KB):                                   # BLOCK_K = 128: one scale per operand row
            A_GATHER: a = A[rows[r0:r0+BM], 128kb:+128]        # fused dispatch, cp.async pipelined
            else:     a = A[r0:r0+BM, 128kb:+128]              # TMA
            b = B[expert, n:n+BN, 128kb:+128]                  # TMA, K-major
            acc += dot_e4m3(a, b^T) * (sa[:, kb] * sb[expert, n // 128, kb])[:, None]    # fp32
        C[r0:r_end, n:n+BN] = acc

Each 128-deep partial sum starts from zero and is promoted to the fp32 accumulator with one FMA per
element: DeepSeek-V3's recipe, which also bounds the tensor core's reduced-precision FP8 accumulation
to 128 products. ``BLOCK_N`` divides 128, so a tile's columns share one weight scale per K tile. A
short last K tile reads zeros (TMA zero-fill, masked gather); a masked row's scale reads 1.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton_fp8.fp8_math import TILE
from megamoe.backends.triton_mx.mx_math import swizzle
from megamoe.quant.fp8 import FP8Tensor


@triton.jit
def _tile_scales(sa_ptrs, sb_ptr, mask_m, kb, num_kb, stride_as_k, stride_bs_k):
    """``sa[rows, kb] * sb[kb]`` of one K tile ``[BLOCK_M]``; 1 past the last tile and for masked rows."""
    live = kb < num_kb
    sa = tl.load(sa_ptrs + kb * stride_as_k, mask=mask_m & live, other=1.0)
    return sa * tl.load(sb_ptr + kb * stride_bs_k, mask=live, other=1.0)


@triton.jit
def _fp8_grouped_gemm_kernel(
    a_ptr,
    a_desc,
    a_scale_ptr,
    a_rows_ptr,
    b_desc,
    b_scale_ptr,
    c_ptr,
    tiles_ptr,
    num_tiles_ptr,
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
    A_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K == 128, "one K tile per 128-element scale")
    tl.static_assert(128 % BLOCK_N == 0, "a tile's columns share one weight scale")
    num_m = tl.load(num_tiles_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    num_kb = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = swizzle(tile_id, num_m, num_n, GROUP_M)
        expert = tl.load(tiles_ptr + 3 * pid_m)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        n0 = pid_n * BLOCK_N
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < r_end
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if A_GATHER:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0)
        else:
            a_rows = offs_m
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]  # A_GATHER only
        sa_ptrs = a_scale_ptr + a_rows.to(tl.int64) * stride_as_r
        sb_ptr = b_scale_ptr + expert.to(tl.int64) * stride_bs_g + (n0 // 128) * stride_bs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the scales one K tile ahead (plain loads are not pipelined by the compiler): the loop never waits
        scale_next = _tile_scales(sa_ptrs, sb_ptr, mask_m, 0, num_kb, stride_as_k, stride_bs_k)
        for kb in range(num_kb):
            k0 = kb * BLOCK_K
            scale = scale_next
            scale_next = _tile_scales(sa_ptrs, sb_ptr, mask_m, kb + 1, num_kb, stride_as_k, stride_bs_k)
            if A_GATHER:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            else:
                a = a_desc.load([r0, k0])
            b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            acc += tl.dot(a, b.T, out_dtype=tl.float32) * scale[:, None]
            a_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])


def fp8_grouped_gemm(
    a: FP8Tensor,
    b: FP8Tensor,
    out: Tensor,
    plan: RoutingPlan,
    *,
    config: TileConfig,
    num_sms: int,
    a_rows: Tensor | None = None,
) -> None:
    """Write ``out [R, N]`` (rows of the plan's tiles only) from FP8 ``a`` and ``b [G, N, K]``.

    ``a`` is ``[R, K]`` expert-sorted, or ``[T, K]`` read through ``a_rows [R]`` (the fused dispatch),
    in 1×128 tiles along K; ``b`` in 128×128 blocks, each expert's rows contiguous (a range of a wider
    weight's rows too). K must be a multiple of 16 (TMA's 16-byte row stride for E4M3).
    """
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bk != TILE or TILE % bn:
        raise ValueError(f"BLOCK_K={bk}, BLOCK_N={bn}: BLOCK_K must be {TILE} and BLOCK_N divide it")
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    _, N, K = b.data.shape
    if a.data.shape[1] != K or a.tile != (1, TILE) or b.tile != (1, TILE, TILE):
        raise ValueError(
            f"a {tuple(a.data.shape)} in tiles {a.tile}, b {tuple(b.data.shape)} in tiles {b.tile}: "
            "expected [*, K] in 1x128 tiles and [G, N, K] in 128x128 blocks"
        )
    if K % 16:
        raise ValueError(f"K={K}: must be a multiple of 16 (E4M3 rows by TMA)")
    b_desc = TensorDescriptor.from_tensor(b.data, [1, bn, bk])
    a_desc = TensorDescriptor.from_tensor(a.data, [bm, bk]) if a_rows is None else None
    grid_size = max(1, min(num_sms * config.programs_per_sm, plan.max_tiles * cdiv(N, bn)))
    _fp8_grouped_gemm_kernel[(grid_size,)](
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
        **config.launch_kwargs(),
    )
