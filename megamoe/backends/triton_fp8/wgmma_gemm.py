"""The M-grouped blockwise-FP8 GEMM of rows in expert order, in Gluon for Hopper: warp-specialised, each
128-deep MMA running while the previous one's partial sum is promoted.

The product, operands, tile table and bits are those of
:func:`megamoe.backends.triton_fp8.grouped_gemm.fp8_grouped_gemm` with ``a_rows=None``: the kernels'
outputs are bit-identical (the GPU tests compare them). What differs is the schedule. ``tl.dot`` waits
for its MMA before the scaled add that promotes the partial sum, so a Triton program's tensor-core work
and its promotion alternate. Here a persistent program of ``128 x BLOCK_N`` tiles is three partitions:

* a producer warp that walks the program's steps (its tiles × their 128-deep K tiles, one flat loop) and
  TMA-loads A ``[128, 128]`` and B ``[BLOCK_N, 128]`` into a ring of ``STAGES`` shared-memory stages,
  with the step's 128 row scales and its weight block's scale beside them (asynchronous copies that the
  stage's ``ready`` barrier also waits for), refilling a stage once both consumers released it
  (``empty``, two arrivals);
* two consumer warpgroups, rows ``[0, 64)`` and ``[64, 128)`` of each tile, each one::

      for step i:
          wait ready[i % STAGES]
          part_i = mma_async(A[i][rows], B[i])          # a fresh fp32 partial sum, 128 deep
          wait until only part_i is in flight; release step i - 1's stage
          acc += part_{i-1} * (sa[rows, kb] * sb[expert, n // 128, kb])[:, None]
          if step i - 1 ended its tile: store acc, acc = 0

The consumers never wait for each other, and the tensor cores run one step while the CUDA cores
promote the one before. A consumer reads its scales from the stage: loaded from global memory by the
consumer itself, each step's next MMA waited for them (ptxas issues their product before it). Two
partial sums and the accumulator, ``64 x BLOCK_N`` fp32 each, live in a consumer's registers; the loop
runs two steps a trip so that the two partials alternate between two register sets (a loop-carried
in-flight accumulator makes ptxas serialise every MMA; the sm_90a compile test checks it does not). A
tile's coordinates are read from the tile table once per tile, not per step. Rows past a segment's end
are computed and never stored; the last K tile reads TMA's zero fill.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton_fp8.fp8_math import TILE
from megamoe.backends.triton_mx.mx_math import swizzle
from megamoe.quant.fp8 import FP8Tensor

MIN_TRITON = (3, 6)  # the Gluon API this is written against
CONSUMER_REGS = 232  # per thread of each consumer warpgroup (the producer warp's group gets 40)
_TRITON_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= MIN_TRITON


@gluon.jit
def _schedule(num_tiles_ptr, N, K, num_programs, BLOCK_N: gl.constexpr):
    """``(m tiles, n tiles, this program's tiles, its steps)``."""
    num_m = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.cdiv(gl.maximum(num_m * num_n - gl.program_id(0), 0), num_programs)
    return num_m, num_n, num_tiles, num_tiles * gl.cdiv(K, 128)


@gluon.jit
def _advance(coords, sched, tiles_ptr, K, num_programs, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """The coordinates ``(k tile, t, expert, first row, row end, first column)`` of the step after
    ``coords`` (step ``kb`` of this program's ``t``-th tile): the next K tile, or the next tile's first
    (its table entry read only then, so a step costs no division). Past the last tile the table reads
    are masked: expert and rows are zeros."""
    kb, t, expert, r0, r_end, n0 = coords
    kb += 1
    if kb == gl.cdiv(K, 128):
        num_m, num_n, num_tiles, _ = sched
        kb = 0
        t += 1
        live = t < num_tiles
        pid_m, pid_n = swizzle(gl.program_id(0) + t * num_programs, num_m, num_n, GROUP_M)
        expert = gl.load(tiles_ptr + 3 * pid_m, mask=live, other=0)
        r0 = gl.load(tiles_ptr + 3 * pid_m + 1, mask=live, other=0)
        r_end = gl.load(tiles_ptr + 3 * pid_m + 2, mask=live, other=0)
        n0 = pid_n * BLOCK_N
    return kb, t, expert, r0, r_end, n0


@gluon.jit
def _before_first_step(K):
    """Coordinates that :func:`_advance` takes to the first step: the last K tile of tile -1."""
    return gl.cdiv(K, 128) - 1, -1, 0, 0, 0, 0


@gluon.jit
def _producer(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    tiles_ptr,
    num_tiles_ptr,
    a_scale_ptr,
    b_scale_ptr,
    N,
    K,
    b_rows,
    stride_as_r,
    stride_as_k,
    stride_bs_g,
    stride_bs_n,
    stride_bs_k,
    num_programs,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: the loads of every step into the ring, a stage refilled once both consumers released
    it. B is viewed as rows of K: an expert's N rows start at ``expert * b_rows``. A stage's scales:
    the rows' in two 64-row halves (zeros past the segment), the weight block's repeated 64 times."""
    sched = _schedule(num_tiles_ptr, N, K, num_programs, BLOCK_N)
    coords = _before_first_step(K)
    lanes = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    for i in range(sched[3]):
        coords = _advance(coords, sched, tiles_ptr, K, num_programs, BLOCK_N, GROUP_M)
        kb, _, expert, r0, r_end, n0 = coords
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes at once
        bar = ready.index(stage)
        for half in gl.static_range(2):
            rows = r0 + 64 * half + lanes
            src = a_scale_ptr + rows.to(gl.int64) * stride_as_r + kb * stride_as_k
            async_copy.async_copy_global_to_shared(sa_bufs.index(2 * stage + half), src, mask=rows < r_end)
        sb_at = expert.to(gl.int64) * stride_bs_g + (n0 // 128) * stride_bs_n + kb * stride_bs_k
        async_copy.async_copy_global_to_shared(sb_bufs.index(stage), b_scale_ptr + sb_at + lanes * 0)
        async_copy.mbarrier_arrive(bar)  # ready also waits for these copies
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [r0, kb * 128], bar, a_bufs.index(stage))
        tma.async_copy_global_to_shared(b_desc, [expert * b_rows + n0, kb * 128], bar, b_bufs.index(stage))


@gluon.jit
def _consumer(
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    tiles_ptr,
    num_tiles_ptr,
    c_ptr,
    N,
    K,
    stride_c,
    num_programs,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warpgroup: rows ``[64 HALF, 64 HALF + 64)`` of every tile, MMAs and promotions."""
    sched = _schedule(num_tiles_ptr, N, K, num_programs, BLOCK_N)
    total = sched[3]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    ctx = (sched, tiles_ptr, sa_bufs, sb_bufs, c_ptr, N, K, stride_c, num_programs)
    zero = gl.zeros([64, BLOCK_N], gl.float32, mma)
    acc = gl.zeros([64, BLOCK_N], gl.float32, mma)
    coords = _before_first_step(K)  # of the step last issued to the tensor cores
    # Two steps a trip, their partial sums in two register sets that alternate: a one-step loop would
    # copy the in-flight partial into the loop-carried one, and ptxas then serialises every MMA.
    p1 = warpgroup_mma_init(zero)
    s1 = gl.zeros([64], gl.float32, gl.SliceLayout(1, mma))  # step -1: nothing to promote
    for j in range(total // 2):
        acc, p0, s0, coords = _step(2 * j, acc, p1, s1, coords, zero, a_bufs, b_bufs, ready, empty, ctx, HALF,
                                    BLOCK_N, GROUP_M, STAGES)  # fmt: skip
        acc, p1, s1, coords = _step(2 * j + 1, acc, p0, s0, coords, zero, a_bufs, b_bufs, ready, empty, ctx,
                                    HALF, BLOCK_N, GROUP_M, STAGES)  # fmt: skip
    if total % 2 == 1:
        acc, p0, s0, coords = _step(total - 1, acc, p1, s1, coords, zero, a_bufs, b_bufs, ready, empty, ctx,
                                    HALF, BLOCK_N, GROUP_M, STAGES)  # fmt: skip
        part = warpgroup_mma_wait(0, deps=(p0,))
        _promote(acc, part, s0, coords, c_ptr, N, K, stride_c, HALF, BLOCK_N)
    else:  # with no step at all, the promotion adds zeros and stores nothing
        part = warpgroup_mma_wait(0, deps=(p1,))
        _promote(acc, part, s1, coords, c_ptr, N, K, stride_c, HALF, BLOCK_N)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """``(ready, empty)``: one mbarrier pair per stage of a ring that a producer warp fills and two
    consumer warpgroups drain (``ready`` completes with the stage's copies, ``empty`` with one arrival
    per consumer), initialised and fenced before the copy engine sees them."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    return ready, empty


@gluon.jit
def invalidate_ring(ready, empty, STAGES: gl.constexpr):
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _wgmma_fp8_gemm_kernel(
    a_desc,
    b_desc,
    a_scale_ptr,
    b_scale_ptr,
    c_ptr,
    tiles_ptr,
    num_tiles_ptr,
    N,
    K,
    b_rows,
    stride_as_r,
    stride_as_k,
    stride_bs_g,
    stride_bs_n,
    stride_bs_k,
    stride_c,
    num_programs,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    gl.static_assert(128 % BLOCK_N == 0, "a tile's columns share one weight scale")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 128, 128], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
    scales: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sa_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 64], scales)  # stage s: rows 2s, 2s + 1
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 64], scales)
    ready, empty = ring_barriers(STAGES)
    # partition arguments go flat (a constexpr inside a tuple argument does not cross the fork)
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, tiles_ptr, num_tiles_ptr, c_ptr, N, K,
                         stride_c, num_programs, gl.constexpr(0), BLOCK_N, GROUP_M, STAGES)),
            (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, tiles_ptr, num_tiles_ptr, c_ptr, N, K,
                         stride_c, num_programs, gl.constexpr(1), BLOCK_N, GROUP_M, STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, tiles_ptr, num_tiles_ptr,
                         a_scale_ptr, b_scale_ptr, N, K, b_rows, stride_as_r, stride_as_k, stride_bs_g, stride_bs_n,
                         stride_bs_k, num_programs, BLOCK_N, GROUP_M, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, 40],
    )  # fmt: skip
    invalidate_ring(ready, empty, STAGES)


@gluon.jit
def _step(
    i,
    acc,
    prev,
    prev_scale,
    coords,
    zero,
    a_bufs,
    b_bufs,
    ready,
    empty,
    ctx,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Issue step ``i``'s MMA, then, while it runs, release the stage step ``i - 1`` read and promote its
    partial sum (``coords`` are step ``i - 1``'s). Returns the accumulator, step ``i``'s in-flight
    partial sum, its scales and its coordinates."""
    sched, tiles_ptr, sa_bufs, sb_bufs, c_ptr, N, K, stride_c, num_programs = ctx
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    sa = sa_bufs.index(2 * stage + HALF).load(prev_scale.type.layout)  # step i's scales, used a step later
    sb = sb_bufs.index(stage).load(prev_scale.type.layout)
    a = a_bufs.index(stage).slice(64 * HALF, 64)
    cur = warpgroup_mma(a, b_bufs.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    part = warpgroup_mma_wait(1, deps=(prev,))
    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = _promote(acc, part, prev_scale, coords, c_ptr, N, K, stride_c, HALF, BLOCK_N)
    coords = _advance(coords, sched, tiles_ptr, K, num_programs, BLOCK_N, GROUP_M)
    return acc, cur, sa * sb, coords


@gluon.jit
def _promote(acc, part, scale, coords, c_ptr, N, K, stride_c, HALF: gl.constexpr, BLOCK_N: gl.constexpr):
    """``acc + part * scale``; where the step at ``coords`` ends its tile (and is a step: ``t >= 0``),
    this warpgroup's rows of the tile are stored (those of its segment, columns below N) and the
    accumulator restarts from zero."""
    acc += part * scale[:, None]
    kb, t, _, r0, r_end, n0 = coords
    if (t >= 0) & (kb == gl.cdiv(K, 128) - 1):
        rows = r0 + 64 * HALF + gl.arange(0, 64, layout=scale.type.layout)
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_c + cols[None, :]
        gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < r_end)[:, None] & (cols < N)[None, :])
        acc = gl.zeros_like(acc)
    return acc


def supported(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: an NVIDIA GPU of compute capability 9.x (its MMA is
    Hopper's) and Triton 3.6 or later."""
    if device.type != "cuda" or torch.version.hip is not None or not _TRITON_OK:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def wgmma_fp8_grouped_gemm(
    a: FP8Tensor, b: FP8Tensor, out: Tensor, plan: RoutingPlan, *, config: TileConfig, num_sms: int
) -> None:
    """Write ``out [R, N]`` (rows of the plan's tiles only; bf16 or fp32) from expert-sorted FP8
    ``a [R, K]`` in 1×128 tiles and ``b [G, N, K]`` in 128×128 blocks (K a multiple of 16; ``b``'s rows
    contiguous, each expert's at any multiple of K: a range of a wider weight's rows), on a GPU where
    :func:`supported`."""
    bn = config.block_n
    if (config.block_m, config.block_k, config.num_warps) != (TILE, TILE, 4) or TILE % bn:
        raise ValueError(
            f"{config}: the tile must be 128 rows (two 64-row consumer warpgroups) by 128 deep, "
            "BLOCK_N divide 128, num_warps 4 (one warpgroup a partition)"
        )
    if config.block_m != plan.block_m:
        raise ValueError(f"BLOCK_M={config.block_m} must equal the plan's block_m={plan.block_m}")
    G, N, K = b.data.shape
    if a.data.shape[1] != K or a.tile != (1, TILE) or b.tile != (1, TILE, TILE) or K % 16:
        raise ValueError(
            f"a {tuple(a.data.shape)} in tiles {a.tile}, b {tuple(b.data.shape)} in tiles {b.tile}: "
            "expected [*, K] in 1x128 tiles and [G, N, K] in 128x128 blocks, K a multiple of 16"
        )
    g_stride, n_stride, k_stride = b.data.stride()
    if g_stride % K or n_stride != K or k_stride != 1:
        raise ValueError(f"b's strides {b.data.stride()}: each expert's [N, K] rows must be contiguous")
    b_rows = g_stride // K
    a_layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, TILE], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a.data, [TILE, TILE], a_layout)
    b_2d = b.data.as_strided(((G - 1) * b_rows + N if G else 0, K), (K, 1))  # expert g's from row g b_rows
    b_desc = TensorDescriptor.from_tensor(b_2d, [bn, TILE], b_layout)
    grid = max(1, min(num_sms * config.programs_per_sm, plan.max_tiles * cdiv(N, bn)))
    _wgmma_fp8_gemm_kernel[(grid,)](
        a_desc, b_desc, a.scale, b.scale, out, plan.tiles_X3, plan.num_tiles_1, N, K, b_rows, a.scale.stride(0),
        a.scale.stride(1), b.scale.stride(0), b.scale.stride(1), b.scale.stride(2), out.stride(0), grid,
        BLOCK_N=bn, GROUP_M=config.group_m, STAGES=config.num_stages, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )  # fmt: skip
