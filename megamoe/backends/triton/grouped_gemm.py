"""Persistent M-grouped GEMM over expert-sorted rows: ``C[r] = A[r] @ B[expert(r)]^T``.

Legend: R rows (expert-sorted), G local experts, N output columns, K reduction, X tile-table rows.

One kernel serves every row-grouped GEMM of the expert path (GEMM1, GEMM2 and both dgrads)::

    for tile in range(program_id, num_m_tiles * num_n_tiles, num_programs):    # persistent, GROUP_M swizzle
        expert, r0, r_end = tiles[m_tile]                                 # device tile table
        for k in range(0, K, BLOCK_K):
            A_MODE 0: a = A[r0:r0+BM, k:k+BK]                             # TMA, contiguous rows
            A_MODE 1: a = A[rows[r0:r0+BM], k:k+BK]                       # fused dispatch: row gather
            acc += a @ B[expert, n:n+BN, k:k+BK]^T   (B_KN: B[expert, k:k+BK, n:n+BN])  # TMA
        C[r0:r_end, n:n+BN] = acc

Rows past a tile's segment end are never stored (they belong to the next expert's tile), so no
expert is padded in memory. B is read through a rank-3 TMA descriptor ``[G, N, K]`` whose bounds
zero-fill ragged K and N. The row gather (A_MODE 1, GEMM1's fused dispatch) measured faster on an
H200 than TMA loads of a pre-gathered copy (782 against 681 TFLOP/s at DeepSeek-V3's GEMM1, one
sweep), so the
forward never materialises the dispatched ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.routing import RoutingPlan


@triton.jit
def _swizzle(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_n
    group = tile_id // width
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % width) % size, (tile_id % width) // size


@triton.jit
def tile_product(
    a_ptrs,
    a_desc,
    r0,
    mask_m,
    b_desc,
    expert,
    n0,
    K,
    A_TMA: tl.constexpr,
    B_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``A[tile rows] @ B[expert][n0:n0+BLOCK_N]^T`` in fp32: A by TMA from row ``r0`` (``A_TMA``) or through
    the row pointers ``a_ptrs`` (rows outside ``mask_m`` read as zero); B by TMA, ``[K, N]`` if ``B_KN``."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k0 = ki * BLOCK_K
        if A_TMA:
            a = a_desc.load([r0, k0])
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            a_ptrs += BLOCK_K
        if B_KN:
            b = b_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        else:
            b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    # pointers / descriptors
    a_ptr,
    a_desc,
    a_rows_ptr,
    b_desc,
    c_ptr,
    tiles_ptr,
    num_tiles_ptr,
    # sizes and strides
    N,
    K,
    stride_a,
    stride_c,
    num_programs,
    # meta-parameters
    A_MODE: tl.constexpr,
    B_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_m = tl.load(num_tiles_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = _swizzle(tile_id, num_m, num_n, GROUP_M)
        expert = tl.load(tiles_ptr + 3 * pid_m)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        n0 = pid_n * BLOCK_N
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < r_end
        if A_MODE == 1:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
        else:
            a_ptrs = a_ptr
        acc = tile_product(
            a_ptrs, a_desc, r0, mask_m, b_desc, expert, n0, K, A_MODE == 0, B_KN, BLOCK_M, BLOCK_N, BLOCK_K
        )
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_gemm(
    a: Tensor,
    b_GNK: Tensor,
    out: Tensor,
    plan: RoutingPlan,
    *,
    a_mode: int,
    b_kn: bool,
    config: dict,
    num_sms: int,
    a_rows: Tensor | None = None,
) -> None:
    """Launch :func:`_grouped_gemm_kernel` writing ``out`` (rows of the plan's tiles only).

    ``b_GNK`` is ``[G, N, K]`` (``b_kn=False``) or ``[G, K, N]`` (``b_kn=True``), contiguous.
    ``a`` is ``[R, K]`` expert-sorted (``a_mode=0``) or ``[T, K]`` gathered through ``a_rows`` (``a_mode=1``).
    """
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    if b_kn:
        K, N = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bk, bn])
    else:
        N, K = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bn, bk])
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk]) if a_mode == 0 else None
    grid_size = min(num_sms, plan.max_tiles * triton.cdiv(N, bn))
    _grouped_gemm_kernel[(grid_size,)](
        a,
        a_desc,
        a_rows,
        b_desc,
        out,
        plan.tiles_X3,
        plan.num_tiles_1,
        N,
        K,
        a.stride(0),
        out.stride(0),
        grid_size,
        A_MODE=a_mode,
        B_KN=b_kn,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=config.get("GROUP_M", 8),
        num_warps=config.get("num_warps", 8),
        num_stages=config.get("num_stages", 3),
    )
