"""The M-grouped blockwise-FP8 GEMM of rows in expert order, in Gluon for Hopper: warp-specialised, each
128-deep MMA running while the partial sum of the one before it is promoted.

The product, operands, tile table and bits are those of
:func:`megamoe.backends.triton_fp8.grouped_gemm.fp8_grouped_gemm` with ``a_rows=None``: the kernels'
outputs are bit-identical (the GPU tests compare them). What differs is the schedule. ``tl.dot`` waits
for its MMA before the scaled add that promotes the partial sum, so a Triton program's tensor-core work
and its promotion alternate. Here a persistent program of ``128 x 192`` tiles is three partitions:

* a producer warp that walks the program's steps (its tiles × their 128-deep K tiles, one flat loop) and
  TMA-loads A ``[128, 128]`` and the tile's two pieces of B, ``[128, 128]`` and ``[64, 128]``, into a
  ring of ``STAGES`` shared-memory stages, with the step's 128 row scales and each piece's weight-block
  scale beside them (asynchronous copies that the stage's ``ready`` barrier also waits for), refilling a
  stage once both consumers released it (``empty``, two arrivals);
* two consumer warpgroups, rows ``[0, 64)`` and ``[64, 128)`` of each tile, each one::

      for step i:
          wait ready[i % STAGES]
          wide_i = mma_async(A[i][rows], B_wide[i])      # fresh fp32 partial sums, 128 deep
          wait for narrow_{i-1}; release step i - 1's stage
          acc_n += narrow_{i-1} * (sa * sb_n)[:, None]  # while wide_i runs
          narrow_i = mma_async(A[i][rows], B_narrow[i])
          wait for wide_i
          acc_w += wide_i * (sa * sb_w)[:, None]        # while narrow_i runs
          a piece whose step ended its tile is stored, its accumulator zeroed:
              its 64 rows into a shared-memory buffer, which the TMA unit writes out
              while the next MMAs run (rows at a segment's end: from registers)

The tile is as wide as the registers allow, so that each operand byte read from L2 (the busiest unit
under ``ncu``) feeds more MMA work than at ``128 x 128`` (docs/history/kernels.md). A piece is a power
of two wide (a tensor's shape must be), and the wide piece starts on a multiple of 128 (first in even
column tiles, second in odd ones), so each piece lies in one weight block and is promoted by one scale
per row. The consumers never wait for each other, and the tensor cores run one piece while the CUDA
cores promote the other. A consumer reads its scales from the stage, each step's MMA waited for them.
The accumulators (``64 x 192`` fp32) and the two partial sums (``64 x 128`` and ``64 x 64``) live in a
consumer's registers; the loop runs two steps a trip so that the narrow partial, in flight from one
step into the next, is not copied into a loop-carried register set (ptxas then serialises every MMA;
the sm_90a compile test checks it does not). A tile's coordinates are read from the tile table once per tile, not per step. Rows past a segment's end and
columns past N are computed and never stored; the last K tile reads TMA's zero fill. A tile's store
goes through shared memory and the TMA unit, so that the consumers go on to the next tile's MMAs while
it is written (storing from the MMA's register layout, each warp instruction writes 16 bytes in each of
8 rows, and the tensor cores waited for it). A bf16 output's two staging buffers take one stage's room;
an fp32 output's would take two, more than the stores gain, so it is stored from registers.
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
SHARED_MEMORY = 232448  # bytes of shared memory one program may take on Hopper (227 KB)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
CONSUMER_REGS = 232  # per thread of each consumer warpgroup (the producer warp's group gets 40)
# A tile's 192 columns are two pieces, 128 and 64 wide: a tensor's width is a power of 2.
WIDE = gl.constexpr(128)
NARROW = gl.constexpr(64)
BLOCK_N = gl.constexpr(WIDE.value + NARROW.value)
_TRITON_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= MIN_TRITON


@gluon.jit
def _piece_columns(pid_n):
    """First columns of the wide (128) and narrow (64) pieces of column tile ``pid_n``: the wide piece
    starts on a multiple of 128, so each piece lies inside one 128-column weight block."""
    odd = pid_n % 2
    n0 = pid_n * BLOCK_N
    return n0 + NARROW * odd, n0 + WIDE * (1 - odd)


@gluon.constexpr_function
def _mma_layout(width):
    """The accumulator layout of one consumer warpgroup's ``64 x width`` MMA."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, width, 32])


@gluon.jit
def _schedule(num_tiles_ptr, N, K, num_programs):
    """``(m tiles, n tiles, this program's tiles, its steps)``."""
    num_m = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.cdiv(gl.maximum(num_m * num_n - gl.program_id(0), 0), num_programs)
    return num_m, num_n, num_tiles, num_tiles * gl.cdiv(K, 128)


@gluon.jit
def _advance(coords, sched, tiles_ptr, K, num_programs, GROUP_M: gl.constexpr):
    """The coordinates ``(k tile, t, expert, first row, row end, column tile)`` of the step after
    ``coords`` (step ``kb`` of this program's ``t``-th tile): the next K tile, or the next tile's first
    (its table entry read only then, so a step costs no division). Past the last tile the table reads
    are masked: expert and rows are zeros."""
    kb, t, expert, r0, r_end, pid_n = coords
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
    return kb, t, expert, r0, r_end, pid_n


@gluon.jit
def _before_first_step(K):
    """Coordinates that :func:`_advance` takes to the first step: the last K tile of tile -1."""
    return gl.cdiv(K, 128) - 1, -1, 0, 0, 0, 0


@gluon.jit
def _producer(
    a_desc,
    bw_desc,
    bn_desc,
    a_bufs,
    bw_bufs,
    bn_bufs,
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
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: the loads of every step into the ring, a stage refilled once both consumers released
    it. B is viewed as rows of K: an expert's N rows start at ``expert * b_rows``. A stage's scales:
    the rows' in two 64-row halves (zeros past the segment), each piece's weight block's repeated 64
    times (zeros past N)."""
    sched = _schedule(num_tiles_ptr, N, K, num_programs)
    coords = _before_first_step(K)
    lanes = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    nbytes: gl.constexpr = a_desc.block_type.nbytes + bw_desc.block_type.nbytes + bn_desc.block_type.nbytes
    for i in range(sched[3]):
        coords = _advance(coords, sched, tiles_ptr, K, num_programs, GROUP_M)
        kb, _, expert, r0, r_end, pid_n = coords
        nw, nn = _piece_columns(pid_n)
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes at once
        bar = ready.index(stage)
        for half in gl.static_range(2):
            rows = r0 + 64 * half + lanes
            src = a_scale_ptr + rows.to(gl.int64) * stride_as_r + kb * stride_as_k
            async_copy.async_copy_global_to_shared(sa_bufs.index(2 * stage + half), src, mask=rows < r_end)
        b_at = b_scale_ptr + expert.to(gl.int64) * stride_bs_g + kb * stride_bs_k + lanes * 0
        async_copy.async_copy_global_to_shared(
            sb_bufs.index(2 * stage), b_at + (nw // 128) * stride_bs_n, mask=nw + lanes * 0 < N
        )
        async_copy.async_copy_global_to_shared(
            sb_bufs.index(2 * stage + 1), b_at + (nn // 128) * stride_bs_n, mask=nn + lanes * 0 < N
        )
        async_copy.mbarrier_arrive(bar)  # ready also waits for these copies
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(a_desc, [r0, kb * 128], bar, a_bufs.index(stage))
        tma.async_copy_global_to_shared(bw_desc, [expert * b_rows + nw, kb * 128], bar, bw_bufs.index(stage))
        tma.async_copy_global_to_shared(bn_desc, [expert * b_rows + nn, kb * 128], bar, bn_bufs.index(stage))


@gluon.jit
def _consumer(
    a_bufs,
    bw_bufs,
    bn_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    tiles_ptr,
    num_tiles_ptr,
    c_ptr,
    cw_desc,
    cn_desc,
    cw_bufs,
    cn_bufs,
    N,
    K,
    stride_c,
    num_programs,
    HALF: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    STAGED: gl.constexpr,
):
    """One warpgroup: rows ``[64 HALF, 64 HALF + 64)`` of every tile, MMAs, promotions and stores (each
    piece's through this warpgroup's staging buffer in ``cw_bufs`` or ``cn_bufs`` where ``STAGED``)."""
    sched = _schedule(num_tiles_ptr, N, K, num_programs)
    wide: gl.constexpr = _mma_layout(WIDE)
    narrow: gl.constexpr = _mma_layout(NARROW)
    zero_w = gl.zeros([64, WIDE], gl.float32, wide)
    zero_n = gl.zeros([64, NARROW], gl.float32, narrow)
    acc_w = gl.zeros([64, WIDE], gl.float32, wide)
    acc_n = gl.zeros([64, NARROW], gl.float32, narrow)
    if STAGED:
        out_w = (c_ptr, cw_desc, cw_bufs.index(HALF), N, stride_c)
        out_n = (c_ptr, cn_desc, cn_bufs.index(HALF), N, stride_c)
    else:
        out_w = (c_ptr, cw_desc, None, N, stride_c)
        out_n = (c_ptr, cn_desc, None, N, stride_c)
    ctx = (sched, tiles_ptr, sa_bufs, sb_bufs, out_w, out_n, K, num_programs)
    prev = _before_first_step(K)  # coordinates of the step before the next
    # Two steps a trip, their narrow partial sums (in flight from one step into the next) in two
    # register sets that alternate: a one-step loop copies the in-flight partial into the loop-carried
    # one, and ptxas then serialises every MMA.
    p1 = warpgroup_mma_init(zero_n)  # step -1: nothing to promote
    s1 = gl.zeros([64], gl.float32, gl.SliceLayout(1, narrow))
    total = sched[3]
    for j in range(total // 2):
        acc_w, acc_n, p0, s0, prev = _step(2 * j, acc_w, acc_n, p1, s1, prev, zero_w, zero_n, a_bufs, bw_bufs,
                                           bn_bufs, ready, empty, ctx, HALF, GROUP_M, STAGES, STAGED)  # fmt: skip
        acc_w, acc_n, p1, s1, prev = _step(2 * j + 1, acc_w, acc_n, p0, s0, prev, zero_w, zero_n, a_bufs,
                                           bw_bufs, bn_bufs, ready, empty, ctx, HALF, GROUP_M, STAGES, STAGED)  # fmt: skip
    if total % 2 == 1:
        acc_w, acc_n, p0, s0, prev = _step(total - 1, acc_w, acc_n, p1, s1, prev, zero_w, zero_n, a_bufs,
                                           bw_bufs, bn_bufs, ready, empty, ctx, HALF, GROUP_M, STAGES, STAGED)  # fmt: skip
        last = warpgroup_mma_wait(0, deps=(p0,))
        _promote(acc_n, last, s0, prev, _piece_columns(prev[5])[1], out_n, K, HALF, STAGED)
    else:  # with no step at all, the promotion adds zeros and stores nothing
        last = warpgroup_mma_wait(0, deps=(p1,))
        _promote(acc_n, last, s1, prev, _piece_columns(prev[5])[1], out_n, K, HALF, STAGED)
    if STAGED:
        tma.store_wait(0)  # the last stores have read their buffers


@gluon.jit
def _step(
    i,
    acc_w,
    acc_n,
    part_n,
    scale_n,
    prev,
    zero_w,
    zero_n,
    a_bufs,
    bw_bufs,
    bn_bufs,
    ready,
    empty,
    ctx,
    HALF: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    STAGED: gl.constexpr,
):
    """Step ``i``: issue its wide MMA; while that runs, release the stage step ``i - 1`` read and promote
    that step's narrow partial sum (``part_n``, ``scale_n``; ``prev`` its coordinates); issue step
    ``i``'s narrow MMA and promote its wide partial while that runs. Returns the accumulators, step
    ``i``'s in-flight narrow partial, its scales and its coordinates."""
    sched, tiles_ptr, sa_bufs, sb_bufs, out_w, out_n, K, num_programs = ctx
    cur = _advance(prev, sched, tiles_ptr, K, num_programs, GROUP_M)
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    a = a_bufs.index(stage).slice(64 * HALF, 64)
    part_w = warpgroup_mma(a, bw_bufs.index(stage).permute((1, 0)), zero_w, use_acc=False, is_async=True)
    scale_w = _scales(sa_bufs, sb_bufs, stage, 0, WIDE, HALF)
    next_scale_n = _scales(sa_bufs, sb_bufs, stage, 1, NARROW, HALF)
    done_n = warpgroup_mma_wait(1, deps=(part_n,))
    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc_n = _promote(acc_n, done_n, scale_n, prev, _piece_columns(prev[5])[1], out_n, K, HALF, STAGED)
    next_n = warpgroup_mma(a, bn_bufs.index(stage).permute((1, 0)), zero_n, use_acc=False, is_async=True)
    done_w = warpgroup_mma_wait(1, deps=(part_w,))
    acc_w = _promote(acc_w, done_w, scale_w, cur, _piece_columns(cur[5])[0], out_w, K, HALF, STAGED)
    return acc_w, acc_n, next_n, next_scale_n, cur


@gluon.jit
def _scales(sa_bufs, sb_bufs, stage, PIECE: gl.constexpr, WIDTH: gl.constexpr, HALF: gl.constexpr):
    """A step's promotion factors for one piece: its rows' scales times the piece's weight-block scale."""
    rows: gl.constexpr = gl.SliceLayout(1, _mma_layout(WIDTH))
    return sa_bufs.index(2 * stage + HALF).load(rows) * sb_bufs.index(2 * stage + PIECE).load(rows)


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
    bw_desc,
    bn_desc,
    a_scale_ptr,
    b_scale_ptr,
    c_ptr,
    cw_desc,
    cn_desc,
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
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    STAGED: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 128, 128], a_desc.layout)
    bw_bufs = gl.allocate_shared_memory(bw_desc.dtype, [STAGES, WIDE, 128], bw_desc.layout)
    bn_bufs = gl.allocate_shared_memory(bn_desc.dtype, [STAGES, NARROW, 128], bn_desc.layout)
    scales: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sa_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 64], scales)  # stage s: rows 2s, 2s + 1
    sb_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 64], scales)  # stage s: pieces 2s, 2s + 1
    ready, empty = ring_barriers(STAGES)
    if STAGED:  # consumer h's buffers: index h
        cw_bufs = gl.allocate_shared_memory(cw_desc.dtype, [2, 64, WIDE], cw_desc.layout)
        cn_bufs = gl.allocate_shared_memory(cn_desc.dtype, [2, 64, NARROW], cn_desc.layout)
    else:  # an fp32 output is stored from registers: the consumers get a placeholder they never touch
        cw_bufs = sb_bufs
        cn_bufs = sb_bufs
    # partition arguments go flat (a constexpr inside a tuple argument does not cross the fork)
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, bw_bufs, bn_bufs, sa_bufs, sb_bufs, ready, empty, tiles_ptr, num_tiles_ptr, c_ptr,
                         cw_desc, cn_desc, cw_bufs, cn_bufs, N, K, stride_c, num_programs,
                         gl.constexpr(0), GROUP_M, STAGES, STAGED)),
            (_consumer, (a_bufs, bw_bufs, bn_bufs, sa_bufs, sb_bufs, ready, empty, tiles_ptr, num_tiles_ptr, c_ptr,
                         cw_desc, cn_desc, cw_bufs, cn_bufs, N, K, stride_c, num_programs,
                         gl.constexpr(1), GROUP_M, STAGES, STAGED)),
            (_producer, (a_desc, bw_desc, bn_desc, a_bufs, bw_bufs, bn_bufs, sa_bufs, sb_bufs, ready, empty,
                         tiles_ptr, num_tiles_ptr, a_scale_ptr, b_scale_ptr, N, K, b_rows, stride_as_r, stride_as_k,
                         stride_bs_g, stride_bs_n, stride_bs_k, num_programs, GROUP_M, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, 40],
    )  # fmt: skip
    invalidate_ring(ready, empty, STAGES)


@gluon.jit
def _promote(acc, part, scale, coords, n_first, out, K, HALF: gl.constexpr, STAGED: gl.constexpr):
    """``acc + part * scale``; where the step at ``coords`` ends its tile (and is a step: ``t >= 0``),
    this warpgroup's rows of the piece starting at column ``n_first`` are stored and the accumulator
    restarts from zero. ``out = (c_ptr, c_desc, c_buf, N, stride_c)``: where ``STAGED``, 64 rows inside
    the segment go through the staging buffer ``c_buf`` by TMA (which drops columns past N), the MMAs
    going on while they are written; the other rows are stored from registers, those past the segment
    never."""
    acc += part * scale[:, None]
    kb, t, _, r0, r_end, _ = coords
    if (t >= 0) & (kb == gl.cdiv(K, 128) - 1):
        c_ptr, c_desc, c_buf, N, stride_c = out
        row0 = r0 + 64 * HALF
        if STAGED:
            if row0 + 64 <= r_end:
                store_by_tma(acc, c_desc, c_buf, row0, n_first)
            else:
                store_rows(acc, row0, r_end, n_first, c_ptr, N, stride_c)
        else:
            store_rows(acc, row0, r_end, n_first, c_ptr, N, stride_c)
        acc = gl.zeros_like(acc)
    return acc


@gluon.jit
def store_by_tma(acc, c_desc, c_buf, row, col):
    """Store a consumer's ``acc`` at ``[row, col]`` of ``c_desc``'s tensor through its staging buffer
    ``c_buf``: the TMA unit writes it out while the consumer goes on (columns past the tensor dropped)."""
    tma.store_wait(0)  # the buffer's last store has read it
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [row, col], c_buf)


@gluon.jit
def store_rows(acc, row0, r_end, n_first, c_ptr, N, stride_c):
    """Store a consumer's ``acc`` at rows ``row0 + [0, 64)`` below ``r_end``, columns ``n_first + ...``
    below N, straight from the MMA's register layout."""
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc.type.layout))
    cols = n_first + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_c + cols[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < r_end)[:, None] & (cols < N)[None, :])


def descriptor(data: Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of ``rows x 128`` E4M3 boxes of ``data`` (2-D, rows of K), in the shared layout
    the MMA reads."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, TILE], gl.float8e4nv)
    return TensorDescriptor.from_tensor(data, [rows, TILE], layout)


def out_descriptor(out: Tensor, cols: int) -> TensorDescriptor:
    """A TMA descriptor of ``64 x cols`` boxes of the 2-D output ``out``, in the staging buffer's layout."""
    if out.stride(1) != 1 or (out.stride(0) * out.element_size()) % 16 or out.data_ptr() % 16:
        raise ValueError(
            f"out {tuple(out.shape)} with strides {out.stride()}: its rows must be contiguous, 16-byte aligned "
            "and a multiple of 16 bytes apart (TMA stores)"
        )
    layout = gl.NVMMASharedLayout.get_default_for([64, cols], _GL_DTYPES[out.dtype])
    return TensorDescriptor.from_tensor(out, [64, cols], layout)


def _staged(out: Tensor) -> bool:
    """Whether tiles are stored through shared memory: a 2-byte output's staging buffers take one stage
    of the ring; an fp32 output's would take two, and it runs faster with them in the ring."""
    return out.element_size() == 2


def _stages(config: TileConfig, out: Tensor) -> int:
    """The ring's stages: the config's, or fewer where they would not fit beside the two consumers'
    staging buffers."""
    stage = TILE * (TILE + BLOCK_N.value) + 2 * 2 * 64 * 4  # A, both B pieces (E4M3), row and block scales
    staging = 2 * 64 * BLOCK_N.value * out.element_size() if _staged(out) else 0
    return min(config.num_stages, (SHARED_MEMORY - staging) // stage)


def supported(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: an NVIDIA GPU of compute capability 9.x (its MMA is
    Hopper's) and Triton 3.6 or later."""
    if device.type != "cuda" or torch.version.hip is not None or not _TRITON_OK:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def wgmma_fp8_grouped_gemm(
    a: FP8Tensor, b: FP8Tensor, out: Tensor, plan: RoutingPlan, *, config: TileConfig, num_sms: int
) -> None:
    """Write ``out [R, N]`` (rows of the plan's tiles only; bf16 or fp32, rows 16-byte aligned) from expert-sorted FP8
    ``a [R, K]`` in 1×128 tiles and ``b [G, N, K]`` in 128×128 blocks (K a multiple of 16; ``b``'s rows
    contiguous, each expert's at any multiple of K: a range of a wider weight's rows), on a GPU where
    :func:`supported`."""
    if (config.block_m, config.block_n, config.block_k, config.num_warps) != (TILE, BLOCK_N.value, TILE, 4):
        raise ValueError(
            f"{config}: the tile must be 128 rows (two 64-row consumer warpgroups) by {BLOCK_N.value} columns by "
            "128 deep, num_warps 4 (one warpgroup a partition)"
        )
    if config.block_m != plan.block_m:
        raise ValueError(f"BLOCK_M={config.block_m} must equal the plan's block_m={plan.block_m}")
    G, N, K = b.data.shape
    if a.data.shape[1] != K or a.tile != (1, TILE) or b.tile != (1, TILE, TILE) or K % 16:
        raise ValueError(
            f"a {tuple(a.data.shape)} in tiles {a.tile}, b {tuple(b.data.shape)} in tiles {b.tile}: "
            "expected [*, K] in 1x128 tiles and [G, N, K] in 128x128 blocks, K a multiple of 16"
        )
    if out.dim() != 2 or out.shape[1] != N:
        raise ValueError(f"out {tuple(out.shape)}: expected [R, {N}]")
    g_stride, n_stride, k_stride = b.data.stride()
    if g_stride % K or n_stride != K or k_stride != 1:
        raise ValueError(f"b's strides {b.data.stride()}: each expert's [N, K] rows must be contiguous")
    b_rows = g_stride // K
    b_2d = b.data.as_strided(((G - 1) * b_rows + N if G else 0, K), (K, 1))  # expert g's from row g b_rows
    grid = max(1, min(num_sms * config.programs_per_sm, plan.max_tiles * cdiv(N, BLOCK_N.value)))
    _wgmma_fp8_gemm_kernel[(grid,)](
        descriptor(a.data, TILE), descriptor(b_2d, WIDE.value), descriptor(b_2d, NARROW.value), a.scale, b.scale, out,
        out_descriptor(out, WIDE.value), out_descriptor(out, NARROW.value), plan.tiles_X3, plan.num_tiles_1, N, K,
        b_rows, a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1), b.scale.stride(2),
        out.stride(0), grid, GROUP_M=config.group_m,
        STAGES=_stages(config, out), CONSUMER_REGS=CONSUMER_REGS, STAGED=_staged(out), num_warps=4,
    )  # fmt: skip
