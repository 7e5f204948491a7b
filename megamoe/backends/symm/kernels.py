"""The fused EP kernel: the comm role (:mod:`.comm`) and the GEMM role (:mod:`.gemm_tile`) in one grid.

Legend: W EP ranks, G local experts, H row width, P pool rows, S send positions (this rank's routed
slots sorted by global expert).

Peers are reached through the workspace's table of buffer bases; the op barrier and the waits are
:mod:`.signals`. Rank-dependent integers and the wait bound are not specialised, so every rank runs
the same compiled kernels and no setting recompiles them mid-run. The kernel's measurement variants
are :data:`megamoe.backends.symm.launch.VARIANTS`; the traced one records each program's timeline
(:data:`TRACE_SLOTS`), read by :func:`.launch.program_timeline`.

The fused kernel has two roles in one persistent grid (comm programs get the lowest ids, so they are
scheduled first and no waiting program can starve them)::

    programs [0, num_comm):  num_comm / W programs per destination d walk its experts g in order, each
                             pushing every (num_comm / W)-th chunk of my rows of expert d*G+g into d's
                             pool (so the first experts land first); the last of them releases
                             pool_ready[me, g] on d
                             (pull mode: for each (my expert g, source s), copy s's staged rows of g
                             into my pool; release my pool_ready[s, g])
                             then join the GEMM role
    every program:           for tile (early experts first; from a device tile counter when a comm
                             role runs, else at a fixed stride):
                                 [WAIT] acquire pool_ready[s, expert] for every source s
                                 acc = A[rows] @ B[expert]   (A rows by pointer loads; [LOCAL_A]
                                   this rank's own rows straight from x, never copied to the pool;
                                   [BCAST_A] a peer's rows from the copy of its x that broadcast
                                   mode put in this workspace, by token)
                                 store locally, or [OUT_REMOTE] push each row to its source's combine slot
                             the last program out resets the counters; [SIGNAL] and releases
                             combine_ready[me] on every rank
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from megamoe.backends.symm.comm import pull_rows, push_rows
from megamoe.backends.symm.gemm_tile import gemm_tile
from megamoe.backends.symm.workspace import STATE_DONE, STATE_TILE
from megamoe.backends.triton.peers import peer_ptr


class SendTables(NamedTuple):
    """The comm role's inputs: this rank's rows and where each goes (push), or the segments of its
    peers' staged rows it copies (pull). Tensors, or None where a launch has no comm role."""

    src: Any
    """``[T, H]`` rows (x or dy); also the GEMM's own rows with ``LOCAL_A`` / ``BCAST_A``"""
    send_token: Any
    send_slot: Any
    send_weight: Any
    send_start: Any
    send_dest_row: Any
    seg_start: Any
    seg_len: Any
    seg_pos: Any


class GemmOperands(NamedTuple):
    """The GEMM role's operands and tile table (None where the launch's flags read nothing); the
    weights' TMA descriptor is the kernel's own argument (Triton's launcher expands descriptors only
    at the top level)."""

    a: Any
    c: Any
    row_scale: Any
    scalar: Any
    row_src: Any
    row_pos: Any
    tiles: Any
    num_tiles: Any
    num_local_tiles: Any


class WorkspaceViews(NamedTuple):
    """The workspace's regions this rank reads and writes (see :mod:`.workspace`), and its peer table."""

    ptrs_dev: Any
    """device address of every rank's buffer base (int64)"""
    state: Any
    pool_ready: Any
    pool: Any
    pool_weight: Any
    combine: Any
    combine_scalar: Any
    combine_ready: Any
    stage_x: Any
    stage_token: Any
    stage_weight: Any
    task_done: Any
    bcast_x: Any
    bcast_token: Any


# jit code reads module globals only as constexprs
_TILE = tl.constexpr(STATE_TILE)
_DONE = tl.constexpr(STATE_DONE)
TRACE_SLOTS = 5
"""per program of the traced variant: start, comm role done, fixed-stride tiles done, end (ns), counter tiles"""
_TRACE_SLOTS = tl.constexpr(TRACE_SLOTS)
PRODUCTION, COMM_ONLY, TRACED = 0, 1, 2
"""the kernel's ``VARIANT``: what the layer runs; the K loop left out (tiles store zeros: the benchmark's
communication-only leg); every program's timeline recorded into ``trace_ptr``"""
_COMM_ONLY = tl.constexpr(COMM_ONLY)
_TRACED = tl.constexpr(TRACED)


@triton.jit
def _trace(trace_ptr, pid, slot, value):
    """Timeline record ``slot`` of program ``pid`` (``TRACE_SLOTS`` int64 per program)."""
    tl.store(trace_ptr + pid * _TRACE_SLOTS + slot, value.to(tl.int64))


@triton.jit
def _now(x, IN_PTX: tl.constexpr):
    """The GPU's global nanosecond timer (0 in the CPU interpreter, which runs no asm); ``x`` is unused."""
    if IN_PTX:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return x.to(tl.int64) * 0


@triton.jit(
    do_not_specialize=[
        "rank",
        "world",
        "G",
        "pool_rows",
        "stage_rows",
        "stage_slots",
        "num_programs",
        "num_comm",
        "tail_pct",
        "max_spins",
    ]
)
def fused_kernel(
    send,
    gemm,
    b_desc,
    views,
    rank,
    world,
    G,
    pool_rows,
    H,
    stage_rows,
    stage_slots,
    N,
    K,
    stride_a,
    stride_c,
    num_programs,
    num_comm,
    tail_pct,
    max_spins,
    COMM: tl.constexpr,
    FLAT: tl.constexpr,
    IN_PTX: tl.constexpr,
    PULL: tl.constexpr,
    PUSH_WEIGHT: tl.constexpr,
    WAIT: tl.constexpr,
    OUT_REMOTE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    PUSH_SCALAR: tl.constexpr,
    SIGNAL: tl.constexpr,
    LOCAL_A: tl.constexpr,
    BCAST_A: tl.constexpr,
    SPREAD: tl.constexpr,
    B_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    COPY_COLS: tl.constexpr,
    trace_ptr,
    VARIANT: tl.constexpr,
):
    """``send``: :class:`SendTables`, ``gemm``: :class:`GemmOperands`, ``b_desc``: the expert weights'
    TMA descriptor, ``views``: :class:`WorkspaceViews`; the integers after them are the sizes."""
    (
        src_ptr, send_token_ptr, send_slot_ptr, send_weight_ptr, send_start_ptr, send_dest_row_ptr,
        seg_start_ptr, seg_len_ptr, seg_pos_ptr,
    ) = send  # fmt: skip
    (
        a_ptr, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr, row_pos_ptr, tiles_ptr, num_tiles_ptr,
        num_local_tiles_ptr,
    ) = gemm  # fmt: skip
    (
        ptrs_dev, state_ptr, pool_ready_ptr, pool_ptr, pool_w_ptr, comb_ptr, comb_scalar_ptr, comb_ready_ptr,
        stage_x_ptr, stage_tok_ptr, stage_w_ptr, task_done_ptr, bcast_x_ptr, bcast_tok_ptr,
    ) = views  # fmt: skip
    pid = tl.program_id(0)
    if VARIANT == _TRACED:
        _trace(trace_ptr, pid, 0, _now(pid, IN_PTX))
    epoch = tl.load(state_ptr)
    bases = ptrs_dev.to(tl.pointer_type(tl.int64))
    if COMM:  # noqa: SIM102 (compile-time branch: the runtime test must not join it)
        if pid < num_comm:
            if PULL:
                pull_rows(
                    pid,
                    num_comm,
                    epoch,
                    bases,
                    rank,
                    world,
                    G,
                    pool_rows,
                    seg_start_ptr,
                    seg_len_ptr,
                    seg_pos_ptr,
                    H,
                    stage_rows,
                    stage_slots,
                    pool_ptr,
                    pool_w_ptr,
                    pool_ready_ptr,
                    stage_x_ptr,
                    stage_tok_ptr,
                    stage_w_ptr,
                    task_done_ptr,
                    PUSH_WEIGHT,
                    COPY_ROWS,
                    COPY_COLS,
                )
            else:
                push_rows(
                    pid,
                    num_comm,
                    epoch,
                    bases,
                    rank,
                    world,
                    G,
                    pool_rows,
                    src_ptr,
                    send_token_ptr,
                    send_slot_ptr,
                    send_weight_ptr,
                    send_start_ptr,
                    send_dest_row_ptr,
                    H,
                    pool_ptr,
                    pool_w_ptr,
                    pool_ready_ptr,
                    task_done_ptr,
                    PUSH_WEIGHT,
                    LOCAL_A,
                    COPY_ROWS,
                    COPY_COLS,
                )
    if VARIANT == _TRACED:
        _trace(trace_ptr, pid, 1, _now(pid, IN_PTX))
    num_m = tl.load(num_tiles_ptr)
    num_local = 0
    if LOCAL_A or SPREAD:  # the table's first num_local tiles hold only this rank's own rows
        num_local = tl.load(num_local_tiles_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    total = num_m * num_n
    # Tiles [0, num_static) go to the GEMM programs at a fixed stride, and Triton pipelines across
    # tiles (flatten): 12-22 % faster than claiming each tile from a counter on 2 x H200. With a comm
    # role the rest are claimed from a device counter by whoever is free, so comm programs join once
    # their rows are out. A flattened loop may hold no loop or branch (Triton 3.6's loop fusion fails
    # on them), so with a comm role it needs FLAT's loop-free waits; without FLAT every tile comes
    # from the counter.
    if COMM:
        gemm_pid = pid - num_comm
        gemm_programs = tl.maximum(num_programs - num_comm, 1)
        num_static = total - (total * tail_pct + 99) // 100 if FLAT else 0
    else:
        gemm_pid = pid
        gemm_programs = num_programs
        num_static = total
    first = tl.where(gemm_pid >= 0, gemm_pid, num_static)  # comm programs skip the fixed-stride part
    ready_expert = -1
    if FLAT or not COMM:
        for tile_id in tl.range(first, num_static, gemm_programs, flatten=True):
            ready_expert = gemm_tile(
                tile_id, ready_expert, epoch, bases, rank, world, G, num_m, num_local, num_n, src_ptr,
                send_token_ptr, a_ptr, b_desc, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr,
                row_pos_ptr, tiles_ptr, state_ptr, pool_ready_ptr, comb_ptr, comb_scalar_ptr, N, K, H,
                stride_a, stride_c, max_spins, bcast_x_ptr, bcast_tok_ptr, stage_rows, stage_slots, WAIT,
                LOCAL_A, OUT_REMOTE, ROW_SCALE, PUSH_SCALAR, VARIANT == _COMM_ONLY, B_KN, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, FLAT, IN_PTX, BCAST_A, SPREAD,
            )  # fmt: skip
    if VARIANT == _TRACED:
        _trace(trace_ptr, pid, 2, _now(pid, IN_PTX))
    counter_tiles = 0
    if COMM:
        tile_id = num_static + tl.atomic_add(state_ptr + _TILE, 1)
        while tile_id < total:
            if VARIANT == _TRACED:
                counter_tiles += 1
            ready_expert = gemm_tile(
                tile_id, ready_expert, epoch, bases, rank, world, G, num_m, num_local, num_n, src_ptr,
                send_token_ptr, a_ptr, b_desc, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr,
                row_pos_ptr, tiles_ptr, state_ptr, pool_ready_ptr, comb_ptr, comb_scalar_ptr, N, K, H,
                stride_a, stride_c, max_spins, bcast_x_ptr, bcast_tok_ptr, stage_rows, stage_slots, WAIT,
                LOCAL_A, OUT_REMOTE, ROW_SCALE, PUSH_SCALAR, VARIANT == _COMM_ONLY, B_KN, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, FLAT, IN_PTX, BCAST_A, SPREAD,
            )  # fmt: skip
            tile_id = num_static + tl.atomic_add(state_ptr + _TILE, 1)
    if VARIANT == _TRACED:
        _trace(trace_ptr, pid, 3, _now(pid, IN_PTX))
        _trace(trace_ptr, pid, 4, counter_tiles)
    # the last program out resets the counters for the next launch and, with SIGNAL, tells every
    # rank that all rows it is owed from here have landed
    tl.debug_barrier()
    done = tl.atomic_add(state_ptr + _DONE, 1, sem="acq_rel", scope="sys")
    if done == num_programs - 1:
        tl.store(state_ptr + _TILE, 0)
        tl.store(state_ptr + _DONE, 0)
        for i0 in range(0, world * G, 1024):
            i = i0 + tl.arange(0, 1024)
            tl.store(task_done_ptr + i, tl.zeros((1024,), dtype=tl.int32), mask=i < world * G)
        if SIGNAL:
            for r in range(world):
                tl.atomic_xchg(
                    peer_ptr(comb_ready_ptr, bases, rank, r) + rank, epoch, sem="release", scope="sys"
                )
