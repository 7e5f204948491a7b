"""K-grouped MXFP8 weight gradient: ``dW[g] = P_g^T Q_g`` summed over expert g's rows.

Legend: R rows (expert-sorted), G local experts, M and N the weight's dimensions, NB block slots.
The operands come from :func:`~megamoe.backends.triton_mx.quantize_segments.quantize_segments`: E4M3
``P^T [M, 32 NB]`` and ``Q^T [N, 32 NB]`` (R contiguous, each expert's rows padded with zeros to whole
blocks of 32 from column ``32 block_start[g]``) and E8M0 codes ``[M, NB]``, ``[N, NB]``::

    for (g, m_tile, n_tile) in tiles[program_id::num_programs]:      # persistent, experts outermost
        acc = 0
        for kb in range(block_start[g], block_start[g + 1]):         # BLOCK_K / 32 per pipeline stage
            acc += dot_e4m3(P^T[m:m+BM, 32kb:+32], Q^T[n:n+BN, 32kb:+32]^T) * (2**sp[m, kb] * 2**sq[n, kb])

Each segment's block count is a multiple of ``BLOCK_K / 32`` (``segment_block_starts(align=)`` pads
with zero blocks), so the stage loop has no guard and never reads the next expert's blocks. Scale
tiles are fetched one stage ahead, as in :mod:`~megamoe.backends.triton_mx.grouped_gemm`.
        dW[g, m:m+BM, n:n+BN] = acc                                  # zero for an expert without rows

Both operands are K-major (what Hopper's FP8 MMA takes) and read by TMA through one host descriptor
each: a segment's blocks never reach another expert's lanes, so no per-expert descriptor is needed.
One fp32 sum per element in block order, no split-K, no atomics: the same bits on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton_mx.mx_math import scale_column, scale_tile, swizzle
from megamoe.quant.mx import BLOCK, MXTensor


@triton.jit
def _mx_wgrad_kernel(
    p_desc,
    q_desc,
    p_scale_ptr,
    q_scale_ptr,
    out_ptr,
    block_start_ptr,
    G,
    M,
    N,
    stride_ps_m,
    stride_ps_b,
    stride_qs_n,
    stride_qs_b,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 32
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    for tile in tl.range(tl.program_id(0), G * per_expert, num_programs, flatten=True):
        expert = tile // per_expert
        pid_m, pid_n = swizzle(tile % per_expert, num_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        b0 = tl.load(block_start_ptr + expert)
        b1 = tl.load(block_start_ptr + expert + 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # scale tiles one stage ahead (plain loads are not pipelined by the compiler)
        sp_next = scale_tile(p_scale_ptr, offs_m, mask_m, b0, b1, stride_ps_m, stride_ps_b, NB)
        sq_next = scale_tile(q_scale_ptr, offs_n, mask_n, b0, b1, stride_qs_n, stride_qs_b, NB)
        for kb0 in range(b0, b1, NB):  # b1 - b0 is a multiple of NB: no guard in the loop body
            sp = sp_next
            sq = sq_next
            sp_next = scale_tile(p_scale_ptr, offs_m, mask_m, kb0 + NB, b1, stride_ps_m, stride_ps_b, NB)
            sq_next = scale_tile(q_scale_ptr, offs_n, mask_n, kb0 + NB, b1, stride_qs_n, stride_qs_b, NB)
            for j in tl.static_range(NB):
                p = p_desc.load([m0, (kb0 + j) * 32])
                q = q_desc.load([n0, (kb0 + j) * 32])
                part = tl.dot(p, q.T, out_dtype=tl.float32)
                acc += (part * scale_column(sq, j, NB)[None, :]) * scale_column(sp, j, NB)[:, None]
        out_ptrs = out_ptr + expert.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def mx_wgrad(
    p: MXTensor,
    q: MXTensor,
    out_GMN: Tensor,
    block_start_G1: Tensor,
    *,
    config: TileConfig,
    num_sms: int,
    block_align: int = 1,
) -> None:
    """Write ``out_GMN[g] = P_g^T Q_g`` from the packed along-R operands ``p [M, 32 NB]``, ``q [N, 32 NB]``.

    ``block_align``: every ``block_start`` is a multiple of it (``segment_block_starts(..., align=)``);
    the tile's ``BLOCK_K / 32`` blocks per stage must divide it.
    """
    bk = config.block_k
    if bk % BLOCK or block_align % (bk // BLOCK):
        raise ValueError(
            f"BLOCK_K={bk}: BLOCK_K / {BLOCK} must divide block_align={block_align} "
            "(the segments' block alignment, segment_block_starts(align=))"
        )
    G, M, N = out_GMN.shape
    if p.data.shape != (M, q.data.shape[1]) or q.data.shape[0] != N or p.dim != 1 or q.dim != 1:
        raise ValueError(
            f"p {tuple(p.data.shape)}, q {tuple(q.data.shape)}: expected [M={M}, L] and [N={N}, L] blocked along L"
        )
    if G == 0 or M == 0 or N == 0:
        return
    bm, bn = config.block_m, config.block_n
    p_desc = TensorDescriptor.from_tensor(p.data, [bm, BLOCK])
    q_desc = TensorDescriptor.from_tensor(q.data, [bn, BLOCK])
    grid_size = min(num_sms * config.programs_per_sm, G * cdiv(M, bm) * cdiv(N, bn))
    _mx_wgrad_kernel[(grid_size,)](
        p_desc,
        q_desc,
        p.scale,
        q.scale,
        out_GMN,
        block_start_G1,
        G,
        M,
        N,
        p.scale.stride(0),
        p.scale.stride(1),
        q.scale.stride(0),
        q.scale.stride(1),
        grid_size,
        **config.launch_kwargs(),
    )
