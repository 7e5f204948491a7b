"""The K-grouped blockwise-FP8 weight gradient in Gluon for Hopper: warp-specialised, one consumer
warpgroup's promotion running while the other's MMA does.

The product, operands and tile order are those of :func:`megamoe.backends.triton_fp8.wgrad.fp8_wgrad`:
``dW[g] = P_g^T Q_g`` from the packed along-R operands ``P^T [M, 128 NB]`` and ``Q^T [N, 128 NB]``
(E4M3, 1×128 tiles along R, expert g's rows in the block slots ``[block_start[g], block_start[g + 1])``),
each 128-deep partial sum promoted as ``acc += (part * sq[n, kb]) * sp[m, kb]``. A persistent program
of ``128 x BLOCK_N`` output tiles (experts outermost) is three partitions:

* a producer warp that walks the program's tiles and each tile's blocks, TMA-loading ``P^T`` and ``Q^T``
  tiles into a ring of ``STAGES`` shared-memory stages, with the block's 128 row and ``BLOCK_N`` column
  scales copied asynchronously beside them (the stage's ``ready`` barrier waits for those too);
* two consumer warpgroups, rows ``[0, 64)`` and ``[64, 128)`` of each tile, each one::

      for each tile:  acc = 0
          for each block kb of its expert:
              wait ready; part = mma(P^T[rows, kb], Q^T[:, kb]^T); wait for it
              read the block's scales from the stage, release the stage
              acc += (part * sq[None, :]) * sp[:, None]
          store acc (zeros for an expert without rows): into a shared-memory buffer that
              the TMA unit writes out while the next tile's MMAs run

A block's promotion scales each element by a row and a column scale, so a consumer holds the
accumulator, one partial sum and the scales of the columns it holds: an MMA is waited for at once
(``warpgroup_mma_wait(0)``) and the two warpgroups overlap each other, one promoting while the
other's MMA runs. Unlike the M-grouped kernel's flat step loop, a tile's steps are its expert's blocks,
so both partitions walk the same two nested loops and count the stages they used. One fp32 sum per
element in block order, no split-K, no atomics: the same bits on every run.
"""

from __future__ import annotations

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton_fp8.fp8_math import TILE
from megamoe.backends.triton_fp8.wgmma_gemm import (
    descriptor,
    invalidate_ring,
    out_descriptor,
    ring_barriers,
    store_by_tma,
    store_rows,
)
from megamoe.backends.triton_fp8.wgrad import check_operands
from megamoe.backends.triton_mx.mx_math import swizzle
from megamoe.quant.fp8 import FP8Tensor

CONSUMER_REGS = 232  # per thread of each consumer warpgroup (the producer warp's group gets 40)


@gluon.jit
def _tile(t, M, N, num_programs, block_start_ptr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """``(expert, first row m0, first column n0, first block, end block)`` of this program's ``t``-th tile."""
    num_m = gl.cdiv(M, 128)
    num_n = gl.cdiv(N, BLOCK_N)
    tile = gl.program_id(0) + t * num_programs
    expert = tile // (num_m * num_n)
    pid_m, pid_n = swizzle(tile % (num_m * num_n), num_m, num_n, GROUP_M)
    b0 = gl.load(block_start_ptr + expert)
    b1 = gl.load(block_start_ptr + expert + 1)
    return expert, pid_m * 128, pid_n * BLOCK_N, b0, b1


@gluon.jit
def _num_tiles(G, M, N, num_programs, BLOCK_N: gl.constexpr):
    total = G * gl.cdiv(M, 128) * gl.cdiv(N, BLOCK_N)
    return gl.cdiv(gl.maximum(total - gl.program_id(0), 0), num_programs)


@gluon.jit
def _producer(
    p_desc,
    q_desc,
    p_bufs,
    q_bufs,
    sp_bufs,
    sq_bufs,
    ready,
    empty,
    p_scale_ptr,
    q_scale_ptr,
    block_start_ptr,
    G,
    M,
    N,
    stride_ps_m,
    stride_ps_b,
    stride_qs_n,
    stride_qs_b,
    num_programs,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: every block of every tile into the ring, a stage refilled once both consumers released
    it. A stage's scales: the tile's rows' in two 64-row halves, its columns' (ones past M and N)."""
    rows64 = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    cols = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0]))
    i = 0
    for t in range(_num_tiles(G, M, N, num_programs, BLOCK_N)):
        _, m0, n0, b0, b1 = _tile(t, M, N, num_programs, block_start_ptr, BLOCK_N, GROUP_M)
        for kb in range(b0, b1):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes at once
            bar = ready.index(stage)
            for half in gl.static_range(2):
                m = m0 + 64 * half + rows64
                src = p_scale_ptr + m.to(gl.int64) * stride_ps_m + kb * stride_ps_b
                async_copy.async_copy_global_to_shared(sp_bufs.index(2 * stage + half), src, mask=m < M)
            n = n0 + cols
            src = q_scale_ptr + n.to(gl.int64) * stride_qs_n + kb * stride_qs_b
            async_copy.async_copy_global_to_shared(sq_bufs.index(stage), src, mask=n < N)
            async_copy.mbarrier_arrive(bar)  # ready also waits for these copies
            mbarrier.expect(bar, p_desc.block_type.nbytes + q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p_desc, [m0, kb * 128], bar, p_bufs.index(stage))
            tma.async_copy_global_to_shared(q_desc, [n0, kb * 128], bar, q_bufs.index(stage))
            i += 1


@gluon.jit
def _consumer(
    p_bufs,
    q_bufs,
    sp_bufs,
    sq_bufs,
    ready,
    empty,
    out_ptr,
    out_desc,
    c_buf,
    block_start_ptr,
    G,
    M,
    N,
    stride_out_g,
    stride_out_m,
    num_programs,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warpgroup: rows ``[64 HALF, 64 HALF + 64)`` of every tile, MMAs, promotions and stores (64
    rows inside the expert's M through the staging buffer ``c_buf`` by TMA, the MMAs of the next tile
    going on while they are written; the rows at M's end from registers)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros([64, BLOCK_N], gl.float32, mma)
    i = 0
    for t in range(_num_tiles(G, M, N, num_programs, BLOCK_N)):
        expert, m0, n0, b0, b1 = _tile(t, M, N, num_programs, block_start_ptr, BLOCK_N, GROUP_M)
        acc = gl.zeros([64, BLOCK_N], gl.float32, mma)
        for _ in range(b0, b1):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            a = p_bufs.index(stage).slice(64 * HALF, 64)
            part = warpgroup_mma(a, q_bufs.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            sp = sp_bufs.index(2 * stage + HALF).load(row_layout)
            sq = sq_bufs.index(stage).load(col_layout)
            mbarrier.arrive(empty.index(stage))
            acc += (part * sq[None, :]) * sp[:, None]
            i += 1
        row0 = m0 + 64 * HALF
        if row0 + 64 <= M:
            store_by_tma(acc, out_desc, c_buf, expert * M + row0, n0)
        else:
            store_rows(acc, row0, M, n0, out_ptr + expert.to(gl.int64) * stride_out_g, N, stride_out_m)
    tma.store_wait(0)  # the last store has read its buffer


@gluon.jit
def _wgmma_fp8_wgrad_kernel(
    p_desc,
    q_desc,
    p_scale_ptr,
    q_scale_ptr,
    out_ptr,
    out_desc,
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
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    p_bufs = gl.allocate_shared_memory(p_desc.dtype, [STAGES, 128, 128], p_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_N, 128], q_desc.layout)
    scales: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sp_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 64], scales)  # stage s: rows 2s, 2s + 1
    sq_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scales)
    ready, empty = ring_barriers(STAGES)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, 64, BLOCK_N], out_desc.layout)  # consumer h's: h
    gl.warp_specialize(
        [
            (_consumer, (p_bufs, q_bufs, sp_bufs, sq_bufs, ready, empty, out_ptr, out_desc, c_bufs.index(0),
                         block_start_ptr, G, M, N, stride_out_g, stride_out_m, num_programs, gl.constexpr(0),
                         BLOCK_N, GROUP_M, STAGES)),
            (_consumer, (p_bufs, q_bufs, sp_bufs, sq_bufs, ready, empty, out_ptr, out_desc, c_bufs.index(1),
                         block_start_ptr, G, M, N, stride_out_g, stride_out_m, num_programs, gl.constexpr(1),
                         BLOCK_N, GROUP_M, STAGES)),
            (_producer, (p_desc, q_desc, p_bufs, q_bufs, sp_bufs, sq_bufs, ready, empty, p_scale_ptr, q_scale_ptr,
                         block_start_ptr, G, M, N, stride_ps_m, stride_ps_b, stride_qs_n, stride_qs_b,
                         num_programs, BLOCK_N, GROUP_M, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, 40],
    )  # fmt: skip
    invalidate_ring(ready, empty, STAGES)


def wgmma_fp8_wgrad(
    p: FP8Tensor, q: FP8Tensor, out_GMN: Tensor, block_start_G1: Tensor, *, config: TileConfig, num_sms: int
) -> None:
    """:func:`megamoe.backends.triton_fp8.wgrad.fp8_wgrad` on a GPU where
    :func:`megamoe.backends.triton_fp8.wgmma_gemm.supported` (data contiguous, ``128 NB`` columns)."""
    bn = config.block_n
    if (config.block_m, config.block_k, config.num_warps) != (TILE, TILE, 4):
        raise ValueError(
            f"{config}: the tile must be 128 rows (two 64-row consumer warpgroups) by 128 deep, num_warps 4"
        )
    G, M, N = check_operands(p, q, out_GMN)
    if G == 0 or M == 0 or N == 0:
        return
    p_desc, q_desc = descriptor(p.data, TILE), descriptor(q.data, bn)
    grid = max(1, min(num_sms * config.programs_per_sm, G * cdiv(M, TILE) * cdiv(N, bn)))
    _wgmma_fp8_wgrad_kernel[(grid,)](
        p_desc, q_desc, p.scale, q.scale, out_GMN, _out_descriptor(out_GMN, bn), block_start_G1, G, M, N, p.scale.stride(0), p.scale.stride(1),
        q.scale.stride(0), q.scale.stride(1), out_GMN.stride(0), out_GMN.stride(1), grid, BLOCK_N=bn, GROUP_M=config.group_m, STAGES=config.num_stages,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=4,
    )  # fmt: skip


def _out_descriptor(out_GMN: Tensor, cols: int):
    """The output's TMA descriptor: ``[G, M, N]`` (a column range of a wider gradient too) viewed as the
    rows ``[G M, N]``, in ``64 x cols`` boxes."""
    G, M, N = out_GMN.shape
    if out_GMN.stride(0) != M * out_GMN.stride(1):
        raise ValueError(
            f"out {tuple(out_GMN.shape)}, strides {out_GMN.stride()}: experts' rows must follow on"
        )
    return out_descriptor(out_GMN.as_strided((G * M, N), out_GMN.stride()[1:]), cols)
