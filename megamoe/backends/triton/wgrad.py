"""K-grouped weight-gradient GEMM: ``dW[g] = P[rows of g]^T @ Q[rows of g]`` for every local expert.

Legend: R rows (expert-sorted), G local experts, M and N the weight's two dimensions.

    for (g, m_tile, n_tile) in tiles[program_id::num_programs]:   # persistent, experts outermost
        acc = 0
        for r in range(start[g], start[g + 1], BLOCK_K):   # the expert's rows are the reduction
            acc += P[r:r+BK, m:m+BM]^T @ Q[r:r+BK, n:n+BN]
        dW[g, m:m+BM, n:n+BN] = acc                   # zero for an expert without rows

P and Q are read through device-side TMA descriptors over the expert's rows, so the last partial
chunk is zero-filled by the copy engine instead of masked in registers. Where an expert has more
tiles than there are programs, a program builds them again only when its next tile belongs to
another expert (a program runs ~7 tiles of an expert in a row in dW1), which is faster than building
them for every tile (measured in docs/history/kernels.md#the-wgrads-tma-descriptors). The grid is
persistent (one program per multiprocessor, loop flattened so the next tile's loads overlap this
tile's epilogue), which gains most where experts have few rows. Both must be contiguous
expert-sorted rows: the backward gathers ``x`` (dW1) and ``dy`` (dW2) into a transient sorted copy
first, because row-gather pointer loads run this kernel much slower than contiguous operands (both
measured in docs/kernels.md#measurements-that-chose-the-design). Each output element is one fp32
sum in row order with no split-K and no atomics: the result has the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.routing import RoutingPlan


def _alloc_scratch(size: int, alignment: int, stream) -> Tensor:
    """Global scratch for device-side TMA descriptors (one per program), from torch's allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton.jit
def _expert_descriptors(
    p_ptr, q_ptr, first, rows, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """TMA descriptors of P and Q over one expert's rows (rows ``first .. first+rows``): TMA zero-fills
    past its last row."""
    start = first.to(tl.int64)
    height = tl.maximum(rows, 1)
    p_desc = tl.make_tensor_descriptor(
        p_ptr + start * M, shape=[height, M], strides=[M, 1], block_shape=[BLOCK_K, BLOCK_M]
    )
    q_desc = tl.make_tensor_descriptor(
        q_ptr + start * N, shape=[height, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N]
    )
    return p_desc, q_desc


@triton.jit
def _wgrad_kernel(
    p_ptr,
    q_ptr,
    out_ptr,
    expert_start_ptr,
    G,
    M,
    N,
    stride_out_g,
    stride_out_m,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    REUSE_DESCRIPTORS: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    if REUSE_DESCRIPTORS:  # carried across the tiles: start with expert 0's
        current = 0
        first = tl.load(expert_start_ptr)
        rows = tl.load(expert_start_ptr + 1) - first
        p_desc, q_desc = _expert_descriptors(p_ptr, q_ptr, first, rows, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    for tile in tl.range(tl.program_id(0), G * per_expert, num_programs, flatten=True):
        expert = tile // per_expert
        local = tile % per_expert
        width = GROUP_M * num_n
        first_m = (local // width) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (local % width) % size
        pid_n = (local % width) // size
        first = tl.load(expert_start_ptr + expert)
        rows = tl.load(expert_start_ptr + expert + 1) - first
        if REUSE_DESCRIPTORS:  # only when this program's tile before was another expert's
            if expert != current:
                p_desc, q_desc = _expert_descriptors(
                    p_ptr, q_ptr, first, rows, M, N, BLOCK_M, BLOCK_N, BLOCK_K
                )
                current = expert
        else:
            p_desc, q_desc = _expert_descriptors(p_ptr, q_ptr, first, rows, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_K):
            p = p_desc.load([r0, m0])
            q = q_desc.load([r0, n0])
            acc = tl.dot(p.T, q, acc)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = (
            out_ptr
            + expert.to(tl.int64) * stride_out_g
            + offs_m[:, None].to(tl.int64) * stride_out_m
            + offs_n[None, :]
        )
        tl.store(
            out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :]
        )


def grouped_wgrad(
    p_RM: Tensor, q_RN: Tensor, out_GMN: Tensor, plan: RoutingPlan, *, config: TileConfig, num_sms: int
) -> None:
    """Write ``out_GMN[g] = P_g^T Q_g`` for contiguous expert-sorted ``P [R, M]`` and ``Q [R, N]``;
    ``out_GMN`` may be a column slice of a wider weight (unit column stride)."""
    G, M, N = out_GMN.shape
    if out_GMN.stride(2) != 1:
        raise ValueError(f"the wgrad's output needs unit column stride, got strides {out_GMN.stride()}")
    bm, bn = config.block_m, config.block_n
    if p_RM.is_cuda:
        triton.set_allocator(_alloc_scratch)
    per_expert = cdiv(M, bm) * cdiv(N, bn)
    grid_size = min(num_sms, G * per_expert)
    _wgrad_kernel[(grid_size,)](
        p_RM.contiguous(),
        q_RN.contiguous(),
        out_GMN,
        plan.expert_start_G1,
        G,
        M,
        N,
        out_GMN.stride(0),
        out_GMN.stride(1),
        grid_size,
        # a program's consecutive tiles are grid_size apart: with fewer tiles per expert, every tile
        # is another expert's and the check would only stand in the pipeline's way
        REUSE_DESCRIPTORS=per_expert > grid_size,
        **config.launch_kwargs(),
    )
