"""K-grouped blockwise-FP8 weight gradient: ``dW[g] = P_g^T Q_g`` summed over expert g's rows.

Legend: R rows (expert-sorted), G local experts, M and N the weight's dimensions, NB 128-row block
slots. The operands come from :func:`~megamoe.backends.triton_fp8.quantize.quantize_segments` (or the
SwiGLU backward): E4M3 ``P^T [M, 128 NB]`` and ``Q^T [N, 128 NB]`` in 1×128 tiles along R, each
expert's rows zero-padded to whole tiles from column ``128 block_start[g]``, scales ``[M, NB]``,
``[N, NB]``::

    for (g, m_tile, n_tile) in tiles[program_id::num_programs]:      # persistent, experts outermost
        acc = 0
        for kb in range(block_start[g], block_start[g + 1]):         # one 128-row tile per stage
            acc += (dot_e4m3(P^T[m:m+BM, 128kb:+128], Q^T[n:n+BN, 128kb:+128]^T) * sq[n, kb]) * sp[m, kb]
        dW[g, m:m+BM, n:n+BN] = acc                                  # zero for an expert without rows

Both operands K-major (what Hopper's FP8 MMA takes), read by TMA through one host descriptor each.
One fp32 sum per element in tile order, no split-K, no atomics: the same bits on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton_fp8.fp8_math import TILE
from megamoe.backends.triton_mx.mx_math import swizzle
from megamoe.quant.fp8 import FP8Tensor


@triton.jit
def _fp8_wgrad_kernel(
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
    stride_out_g,
    stride_out_m,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K == 128, "one 128-row tile per stage")
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
        sp_ptrs = p_scale_ptr + offs_m * stride_ps_m
        sq_ptrs = q_scale_ptr + offs_n * stride_qs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # scales one stage ahead (plain loads are not pipelined by the compiler)
        sp_next = tl.load(sp_ptrs + b0 * stride_ps_b, mask=mask_m & (b0 < b1), other=1.0)
        sq_next = tl.load(sq_ptrs + b0 * stride_qs_b, mask=mask_n & (b0 < b1), other=1.0)
        for kb in range(b0, b1):
            sp = sp_next
            sq = sq_next
            sp_next = tl.load(sp_ptrs + (kb + 1) * stride_ps_b, mask=mask_m & (kb + 1 < b1), other=1.0)
            sq_next = tl.load(sq_ptrs + (kb + 1) * stride_qs_b, mask=mask_n & (kb + 1 < b1), other=1.0)
            p = p_desc.load([m0, kb * BLOCK_K])
            q = q_desc.load([n0, kb * BLOCK_K])
            acc += (tl.dot(p, q.T, out_dtype=tl.float32) * sq[None, :]) * sp[:, None]
        out_ptrs = (
            out_ptr
            + expert.to(tl.int64) * stride_out_g
            + offs_m[:, None].to(tl.int64) * stride_out_m
            + offs_n[None, :]
        )
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def check_operands(p: FP8Tensor, q: FP8Tensor, out_GMN: Tensor) -> tuple[int, int, int]:
    """``(G, M, N)`` of ``out_GMN`` (unit column stride: it may be a column slice of a wider weight), once
    ``p`` and ``q`` are its packed along-R operands in 1×128 tiles."""
    G, M, N = out_GMN.shape
    if out_GMN.stride(2) != 1:
        raise ValueError(f"the wgrad's output needs unit column stride, got strides {out_GMN.stride()}")
    if (
        p.data.shape != (M, q.data.shape[1])
        or q.data.shape[0] != N
        or p.tile != (1, TILE)
        or q.tile != (1, TILE)
    ):
        raise ValueError(
            f"p {tuple(p.data.shape)}, q {tuple(q.data.shape)}: expected [M={M}, L] and [N={N}, L] in 1x128 tiles"
        )
    return G, M, N


def fp8_wgrad(
    p: FP8Tensor, q: FP8Tensor, out_GMN: Tensor, block_start_G1: Tensor, *, config: TileConfig, num_sms: int
) -> None:
    """Write ``out_GMN[g] = P_g^T Q_g`` from the packed along-R operands ``p [M, 128 NB]``, ``q [N, 128 NB]``."""
    if config.block_k != TILE:
        raise ValueError(f"BLOCK_K={config.block_k}: must be {TILE} (one 128-row tile per stage)")
    G, M, N = check_operands(p, q, out_GMN)
    if G == 0 or M == 0 or N == 0:
        return
    bm, bn = config.block_m, config.block_n
    p_desc = TensorDescriptor.from_tensor(p.data, [bm, TILE])
    q_desc = TensorDescriptor.from_tensor(q.data, [bn, TILE])
    grid_size = min(num_sms * config.programs_per_sm, G * cdiv(M, bm) * cdiv(N, bn))
    _fp8_wgrad_kernel[(grid_size,)](
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
        out_GMN.stride(0),
        out_GMN.stride(1),
        grid_size,
        **config.launch_kwargs(),
    )
