"""K-grouped weight-gradient GEMM: ``dW[g] = P[rows of g]^T @ Q[rows of g]`` for every local expert.

Legend: R rows (expert-sorted), G local experts, M and N the weight's two dimensions.

    for (g, m_tile, n_tile) in grid:                  # one program per output tile, experts outermost
        acc = 0
        for r in range(start[g], start[g + 1], BLOCK_K):   # the expert's rows are the reduction
            acc += P[p_rows[r:r+BK], m:m+BM]^T @ Q[q_rows[r:r+BK], n:n+BN]
        dW[g, m:m+BM, n:n+BN] = acc                   # zero for an expert without rows

``p_rows``/``q_rows`` gather rows by index (the recomputed dispatch of ``x`` for dW1, of ``dy`` for
dW2), so no dispatched copy is materialised. Each output element is one fp32 sum in row order with
no split-K and no atomics: the result has the same bits on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.routing import RoutingPlan


@triton.jit
def _wgrad_kernel(
    p_ptr,
    p_rows_ptr,
    q_ptr,
    q_rows_ptr,
    out_ptr,
    expert_start_ptr,
    M,
    N,
    stride_p,
    stride_q,
    P_GATHER: tl.constexpr,
    Q_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    expert = pid // per_expert
    local = pid % per_expert
    width = GROUP_M * num_n
    first_m = (local // width) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % size
    pid_n = (local % width) // size
    start = tl.load(expert_start_ptr + expert)
    end = tl.load(expert_start_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        mask_r = rows < end
        if P_GATHER:
            p_rows = tl.load(p_rows_ptr + rows, mask=mask_r, other=0).to(tl.int64)
        else:
            p_rows = rows.to(tl.int64)
        if Q_GATHER:
            q_rows = tl.load(q_rows_ptr + rows, mask=mask_r, other=0).to(tl.int64)
        else:
            q_rows = rows.to(tl.int64)
        p = tl.load(
            p_ptr + p_rows[:, None] * stride_p + offs_m[None, :],
            mask=mask_r[:, None] & mask_m[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_q + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = tl.dot(p.T, q, acc)
    out_ptrs = out_ptr + expert.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_wgrad(
    p: Tensor,
    q: Tensor,
    out_GMN: Tensor,
    plan: RoutingPlan,
    *,
    config: dict,
    p_rows: Tensor | None = None,
    q_rows: Tensor | None = None,
) -> None:
    """Write ``out_GMN[g] = P_g^T Q_g`` (``P [*, M]``, ``Q [*, N]``; rows gathered when ``*_rows`` given)."""
    G, M, N = out_GMN.shape
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    grid = (G * triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _wgrad_kernel[grid](
        p,
        p_rows,
        q,
        q_rows,
        out_GMN,
        plan.expert_start_G1,
        M,
        N,
        p.stride(0),
        q.stride(0),
        P_GATHER=p_rows is not None,
        Q_GATHER=q_rows is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=config.get("GROUP_M", 8),
        num_warps=config.get("num_warps", 8),
        num_stages=config.get("num_stages", 3),
    )
