"""Persistent M-grouped MXFP8 GEMM over expert-sorted rows: ``C[r] = A[r] @ B[expert(r)]^T``.

Legend: R rows (expert-sorted), G local experts, N output columns, K reduction, KB = ceil(K / 32).
A ``[rows, K]`` and B ``[G, N, K]`` are E4M3 with one E8M0 code per 32 along K (``sa [rows, KB]``,
``sb [G, N, KB]``, any strides). Same schedule as :mod:`megamoe.backends.triton.grouped_gemm`
(device tile table, persistent grid, GROUP_M swizzle, rows never padded in memory)::

    for tile in range(program_id, num_m_tiles * num_n_tiles, num_programs):
        expert, r0, r_end = tiles[m_tile]
        for stage in range(cdiv(K, BLOCK_K)):                  # NB = BLOCK_K / 32 MX blocks a stage
            sa, sb = 2**(codes - 127) of A's rows, B's columns for the stage's NB blocks  # [BM|BN, NB]
            for kb in the stage's NB blocks:                   # unrolled
                A_GATHER: a = A[rows[r0:r0+BM], 32kb:32kb+32]  # fused dispatch, cp.async pipelined
                else:     a = A[r0:r0+BM, 32kb:32kb+32]        # TMA
                b = B[expert, n:n+BN, 32kb:32kb+32]            # TMA, K-major ([BN, 32] then .T)
                acc += (dot_e4m3(a, b^T) * sb[:, kb][None, :]) * sa[:, kb][:, None]   # fp32
        C[r0:r_end, n:n+BN] = acc                            # [OUT_REMOTE] rows to their sources' combine slots

``OUT_REMOTE`` (the EP combine over symmetric memory, :class:`RemoteRows`): each output row [times its
routing weight] goes to its source rank's combine slot [with a per-row scalar], as the bf16 fused
kernel's epilogue does; the last program out releases ``combine_ready[me]`` on every rank.

Each 32-deep MMA (Hopper ``wgmma`` k=32 for E4M3) starts from zero and its fp32 result is scaled and
added on the CUDA cores: that is where the per-32 scales enter, and it also promotes Hopper's reduced-
precision FP8 accumulation to fp32 after every block. It costs one multiply and one FMA per output
element per 32 of K, which on Hopper is about what the tensor core spends on the MMA itself (see
docs/mxfp8.md). A short last K block reads zeros (TMA zero-fill, masked gather). A masked row's codes
read as 127 (scale 1), so nothing NaN enters from outside the tile.

Performance notes (checked by compiling for sm_90a offline: ``ptxas -v`` registers and spills, TTGIR):
the scale tiles are plain loads, which the software pipeliner does not pipeline, so they are fetched
one stage ahead in registers; one ``[rows, NB]`` tile per stage, its columns picked by ``tl.split``
(no reductions, no per-step scale loads); the gathered A rows come through pointers carried across
the loop (``a_ptrs += BLOCK_K``), which the pipeliner turns into ``cp.async``; the partial is scaled
as ``(part * sb) * sa`` so no separate ``[BM, BN]`` scale tile is built and held.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.peers import peer_ptr
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton_mx.mx_math import scale_column, scale_tile, swizzle
from megamoe.quant.mx import BLOCK, MXTensor


@dataclass(frozen=True, slots=True)
class RemoteRows:
    """Where :func:`mx_grouped_gemm` sends its output rows instead of ``out``: each pool row to its source
    rank's combine slot in the symmetric workspace (:mod:`megamoe.backends.symm`); a peer's slot is this
    rank's address shifted by the difference of the two buffer bases."""

    row_src_R: Tensor
    row_pos_R: Tensor
    """each row's source rank and its send position there (the combine slot)."""
    combine: Tensor
    """this rank's combine slots ``[slots, N]``."""
    combine_scalar: Tensor
    combine_ready: Tensor
    epoch_1: Tensor
    done_1: Tensor
    """programs finished (the last one resets it and signals)."""
    ptrs_dev: int
    rank: int
    world: int
    row_scale_R: Tensor | None = None
    """float32, multiplies each row before it is sent (the routing weight)."""
    scalar_R: Tensor | None = None
    """float32, sent with each row to ``combine_scalar``."""


@triton.jit(do_not_specialize=["rank", "world"])  # every rank runs the same compiled kernel
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
    # OUT_REMOTE
    row_scale_ptr,
    scalar_ptr,
    row_src_ptr,
    row_pos_ptr,
    comb_scalar_ptr,
    comb_ready_ptr,
    epoch_ptr,
    done_ptr,
    ptrs_dev,
    rank,
    world,
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
    OUT_REMOTE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    PUSH_SCALAR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 32
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
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        if A_GATHER:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0)
        else:
            a_rows = offs_m
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]  # A_GATHER only
        sb_ptr = b_scale_ptr + expert.to(tl.int64) * stride_bs_g
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # scale tiles one stage ahead (plain loads are not pipelined by the compiler): the loop never waits
        sa_next = scale_tile(a_scale_ptr, a_rows, mask_m, 0, num_kb, stride_as_r, stride_as_k, NB)
        sb_next = scale_tile(sb_ptr, offs_n, mask_n, 0, num_kb, stride_bs_n, stride_bs_k, NB)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            kb0 = ki * NB
            sa = sa_next
            sb = sb_next
            sa_next = scale_tile(a_scale_ptr, a_rows, mask_m, kb0 + NB, num_kb, stride_as_r, stride_as_k, NB)
            sb_next = scale_tile(sb_ptr, offs_n, mask_n, kb0 + NB, num_kb, stride_bs_n, stride_bs_k, NB)
            for j in tl.static_range(NB):
                k0 = (kb0 + j) * 32
                if A_GATHER:
                    a_mask = mask_m[:, None] & (offs_k < K - k0)[None, :]
                    a = tl.load(a_ptrs + j * 32, mask=a_mask, other=0.0)
                else:
                    a = a_desc.load([r0, k0])
                b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, 32)
                part = tl.dot(a, b.T, out_dtype=tl.float32)
                acc += (part * scale_column(sb, j, NB)[None, :]) * scale_column(sa, j, NB)[:, None]
            a_ptrs += BLOCK_K
        mask = mask_m[:, None] & mask_n[None, :]
        if OUT_REMOTE:  # each row to its source's copy of the combine slots: local pointer + the peer's shift
            bases = ptrs_dev.to(tl.pointer_type(tl.int64))
            src = tl.load(row_src_ptr + offs_m, mask=mask_m, other=0)
            pos = tl.load(row_pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            shift = tl.load(bases + src, mask=mask_m, other=0) - tl.load(bases + rank)
            if ROW_SCALE:
                acc = acc * tl.load(row_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
            # page-aligned bases and N % 8 == 0: the hint keeps 16-byte stores
            row = tl.multiple_of(shift // (c_ptr.dtype.element_ty.primitive_bitwidth // 8) + pos * N, 8)
            tl.store(c_ptr + row[:, None] + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
            if PUSH_SCALAR:  # the first column tile sends it (a mask, not a branch)
                first_n = mask_m & (pid_n == 0)
                v = tl.load(scalar_ptr + offs_m, mask=first_n, other=0.0)
                tl.store(comb_scalar_ptr + shift // 4 + pos, v, mask=first_n)
        else:
            c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    if OUT_REMOTE:  # the last program out tells every rank that all rows it is owed from here landed
        tl.debug_barrier()
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == num_programs - 1:
            tl.store(done_ptr, 0)
            epoch = tl.load(epoch_ptr)
            bases = ptrs_dev.to(tl.pointer_type(tl.int64))
            for r in range(world):
                tl.atomic_xchg(
                    peer_ptr(comb_ready_ptr, bases, rank, r) + rank, epoch, sem="release", scope="sys"
                )


def mx_grouped_gemm(
    a: MXTensor,
    b: MXTensor,
    out: Tensor | None,
    plan: RoutingPlan,
    *,
    config: TileConfig,
    num_sms: int,
    a_rows: Tensor | None = None,
    remote: RemoteRows | None = None,
) -> None:
    """Write ``out [R, N]`` (rows of the plan's tiles only) from MX ``a`` and ``b [G, N, K]``, or send
    the rows to their sources (``remote``; ``out`` then None).

    ``a`` is ``[R, K]`` expert-sorted, or ``[T, K]`` read through ``a_rows [R]`` (the fused dispatch).
    Both are blocked along K (their last dim) and their data contiguous; K must be a multiple of 16
    (TMA's 16-byte row stride for E4M3).
    """
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bk % BLOCK or bk & (bk - 1):
        raise ValueError(f"BLOCK_K={bk}: must be a power of two and a multiple of {BLOCK}")
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    if (out is None) == (remote is None):
        raise ValueError("pass exactly one of out and remote")
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
    grid_size = max(1, min(num_sms * config.programs_per_sm, plan.max_tiles * cdiv(N, bn)))
    r = remote
    c = out if r is None else r.combine
    _mx_grouped_gemm_kernel[(grid_size,)](
        a.data,
        a_desc,
        a.scale,
        a_rows,
        b_desc,
        b.scale,
        c,
        plan.tiles_X3,
        plan.num_tiles_1,
        None if r is None else r.row_scale_R,
        None if r is None else r.scalar_R,
        None if r is None else r.row_src_R,
        None if r is None else r.row_pos_R,
        None if r is None else r.combine_scalar,
        None if r is None else r.combine_ready,
        None if r is None else r.epoch_1,
        None if r is None else r.done_1,
        0 if r is None else r.ptrs_dev,
        0 if r is None else r.rank,
        1 if r is None else r.world,
        N,
        K,
        a.data.stride(0),
        a.scale.stride(0),
        a.scale.stride(1),
        b.scale.stride(0),
        b.scale.stride(1),
        b.scale.stride(2),
        c.stride(0),
        grid_size,
        A_GATHER=a_rows is not None,
        OUT_REMOTE=r is not None,
        ROW_SCALE=r is not None and r.row_scale_R is not None,
        PUSH_SCALAR=r is not None and r.scalar_R is not None,
        **config.launch_kwargs(),
    )
