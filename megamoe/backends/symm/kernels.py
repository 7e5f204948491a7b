"""Triton kernels of the fused multi-GPU path: the op barrier, the comm + grouped-GEMM kernel, waits.

Legend: W EP ranks, G local experts, H row width, P pool rows, S send positions (this rank's routed
slots sorted by global expert).

Peers are reached through the workspace's table of buffer bases (``buffer_ptrs_dev``): a peer's
region is ``base[r] + offset``, loaded and stored like local memory. Signals are release stores of
the op epoch at system scope; waits poll with acquire loads until ``>= epoch``, so nothing is reset
between ops. A bounded wait (debug mode) records what it waited on and gives up instead of hanging.

Rank-dependent integers and the wait bound are not specialised, so every rank runs the same
compiled kernels and no setting recompiles them mid-run. With ``TRACE`` (``MEGAMOE_SYMM_TRACE=1``)
every program records its timeline (:data:`TRACE_SLOTS`), read by :func:`.launch.program_timeline`.

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

import triton
import triton.language as tl

from megamoe.backends.symm.workspace import (
    COUNTER_ARRIVE,
    COUNTER_POOL,
    STATE_DONE,
    STATE_ERROR,
    STATE_TILE,
)
from megamoe.backends.triton.grouped_gemm import _swizzle, tile_product
from megamoe.backends.triton.side_gather import copy_rows_streaming

# jit code reads module globals only as constexprs
_TILE = tl.constexpr(STATE_TILE)
_DONE = tl.constexpr(STATE_DONE)
_ERROR = tl.constexpr(STATE_ERROR)
_ARRIVE = tl.constexpr(COUNTER_ARRIVE)
_POOL = tl.constexpr(COUNTER_POOL)
MAX_FLAT_WORLD = 8
"""largest EP group whose waits the flattened tile loop unrolls (larger groups claim every tile)"""
_MAX_FLAT_WORLD = tl.constexpr(MAX_FLAT_WORLD)
TRACE_SLOTS = 5
"""per program with ``TRACE``: start, comm role done, fixed-stride tiles done, end (ns), counter tiles"""
_TRACE_SLOTS = tl.constexpr(TRACE_SLOTS)


@triton.jit
def _spin_until(ptr, expected, state_ptr, rank, counter_id, index, max_spins):
    """Acquire-poll ``*ptr`` until ``>= expected``; after ``max_spins`` polls record the failure and return."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < expected) & (spins < max_spins):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        spins += 1
    _record_timeout(seen, expected, state_ptr, rank, counter_id, index)


# If ``$4`` (need) is set: ``$0 = *$1`` re-read with acquire semantics at system scope until ``>= $2`` or
# ``$3`` polls. Else no load at all and ``$0 = $2`` (a satisfied wait): a system-scope acquire is not
# free, and most tiles await nothing (their expert's flags were polled for an earlier tile). The loop
# is inside the asm block, so a Triton loop around it stays one loop (and may be flattened); ``$0`` is
# written last, so it may share a register with an input.
_POLL_PTX = tl.constexpr("""{
.reg .pred poll_p;
.reg .pred poll_q;
.reg .s32 poll_n;
.reg .s32 poll_v;
mov.s32 poll_v, $2;
setp.eq.s32 poll_p, $4, 0;
@poll_p bra POLL_DONE;
mov.s32 poll_n, 0;
POLL_AGAIN:
ld.acquire.sys.global.b32 poll_v, [$1];
setp.lt.s32 poll_p, poll_v, $2;
setp.lt.s32 poll_q, poll_n, $3;
and.pred poll_p, poll_p, poll_q;
add.s32 poll_n, poll_n, 1;
@poll_p bra POLL_AGAIN;
POLL_DONE:
mov.s32 $0, poll_v;
}""")


@triton.jit
def _wait_flag(ptr, expected, need, state_ptr, rank, counter_id, index, max_spins, IN_PTX: tl.constexpr):
    """:func:`_spin_until` if ``need``, without a branch (so a flattened tile loop may hold it): the poll
    loop is inline PTX when ``IN_PTX`` (GPUs); the CPU interpreter, which runs no asm, polls a wait
    that is not needed against an epoch that is always reached."""
    if IN_PTX:
        seen = tl.inline_asm_elementwise(
            _POLL_PTX,
            "=r,l,r,r,r",
            [ptr.to(tl.int64), expected, max_spins, need.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        _record_timeout(seen, expected, state_ptr, rank, counter_id, index)
    else:
        _spin_until(ptr, tl.where(need, expected, -2147483647), state_ptr, rank, counter_id, index, max_spins)


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


@triton.jit
def _record_timeout(seen, expected, state_ptr, rank, counter_id, index):
    """If a wait gave up, keep the first failure in the workspace state (:meth:`SymmWorkspace.check`)."""
    if seen < expected:
        first = tl.atomic_cas(state_ptr + _ERROR, 0, 1) == 0  # keep the first failure
        if first:
            tl.store(state_ptr + _ERROR + 1, rank)
            tl.store(state_ptr + _ERROR + 2, counter_id)
            tl.store(state_ptr + _ERROR + 3, index)
            tl.store(state_ptr + _ERROR + 4, seen)
            tl.store(state_ptr + _ERROR + 5, expected)


@triton.jit(do_not_specialize=["rank", "world", "E", "G", "max_spins"])
def _barrier_kernel(
    ptrs_dev,
    state_ptr,
    counts_ptr,
    signal_ptr,
    rank,
    world,
    E,
    G,
    arrive_ptr,
    counts_all_ptr,
    max_spins,
    HAS_COUNTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Start an op: bump the epoch, write it once per local expert into ``signal`` (broadcast mode's
    copy engines send that as the rows' flags), [publish my counts,] barrier with every rank."""
    epoch = tl.load(state_ptr) + 1
    tl.store(state_ptr, epoch)
    offs = tl.arange(0, BLOCK_E)
    for g0 in range(0, G, BLOCK_E):
        tl.store(signal_ptr + g0 + offs, tl.full((BLOCK_E,), 0, tl.int32) + epoch, mask=g0 + offs < G)
    bases = ptrs_dev.to(tl.pointer_type(tl.int64))
    for r in range(world):
        if HAS_COUNTS:
            dst = peer_ptr(counts_all_ptr, bases, rank, r) + ((epoch % 2) * world + rank) * E
            for e0 in range(0, E, BLOCK_E):
                mask = e0 + offs < E
                tl.store(dst + e0 + offs, tl.load(counts_ptr + e0 + offs, mask=mask), mask=mask)
        tl.debug_barrier()
        tl.atomic_xchg(peer_ptr(arrive_ptr, bases, rank, r) + rank, epoch, sem="release", scope="sys")
    for s in range(world):
        _spin_until(arrive_ptr + s, epoch, state_ptr, rank, _ARRIVE, s, max_spins)


@triton.jit(do_not_specialize=["n", "rank", "max_spins"])
def _wait_kernel(flags_ptr, n, state_ptr, rank, counter_id, max_spins):
    """Wait until every one of ``flags[0:n]`` reached this op's epoch."""
    epoch = tl.load(state_ptr)
    for i in range(n):
        _spin_until(flags_ptr + i, epoch, state_ptr, rank, counter_id, i, max_spins)


@triton.jit(
    do_not_specialize=["rank", "world", "G", "stage_rows", "stage_slots", "num_programs", "max_spins"]
)
def _gather_broadcast_rows_kernel(
    src_ptr, send_token_ptr, bcast_x_ptr, bcast_tok_ptr, row_src_ptr, row_pos_ptr, expert_start_ptr,
    pool_ptr, state_ptr, pool_ready_ptr, rank, world, G, H, stage_rows, stage_slots, num_programs,
    max_spins, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Broadcast mode's backward, beside the dgrad kernel: fill the pool (the wgrad's TMA-read rows)
    from this rank's own rows (``src`` by token) and the peers' copies, once every peer released its
    copy (``pool_ready[s, 0]``: its copy engine writes all of ``pool_ready[s, *]`` at once, after the rows)."""
    epoch = tl.load(state_ptr)
    for s in range(world):
        if s != rank:
            _spin_until(pool_ready_ptr + s * G, epoch, state_ptr, rank, _POOL, s * G, max_spins)
    valid = tl.load(expert_start_ptr + G)
    for block in range(tl.program_id(0), tl.cdiv(valid, BLOCK_R), num_programs):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < valid
        src = tl.load(row_src_ptr + rows, mask=ok, other=0)
        pos = tl.load(row_pos_ptr + rows, mask=ok, other=0)
        own, peer = ok & (src == rank), ok & (src != rank)
        token = tl.load(send_token_ptr + pos, mask=own, other=0).to(tl.int64)
        peer_token = tl.load(bcast_tok_ptr + src * stage_slots + pos, mask=peer, other=0).to(tl.int64)
        peer_row = src.to(tl.int64) * stage_rows + peer_token
        from_rows = tl.where(own, src_ptr + token * H, bcast_x_ptr + peer_row * H)
        copy_rows_streaming(from_rows, pool_ptr + rows.to(tl.int64) * H, ok, H, BLOCK_H)


@triton.jit(do_not_specialize=["rank", "G", "P", "stage_slots"])
def _pool_weights_kernel(
    row_src_ptr, row_pos_ptr, expert_start_ptr, own_weight_ptr, copied_weight_ptr, out_ptr, rank, G, P,
    stage_slots, BROADCAST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Stage 1 forward, after the GEMM: each pool row's routing weight in the output dtype, 0 past the
    valid rows. Push/pull: the weights the comm role put in ``pool_weight`` (``copied_weight``). Broadcast:
    own rows from this rank's send-order weights, a peer's from the copy it made of its own (valid once
    the GEMM's waits saw its flag)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < tl.load(expert_start_ptr + G)
    if BROADCAST:
        src = tl.load(row_src_ptr + rows, mask=valid, other=0)
        pos = tl.load(row_pos_ptr + rows, mask=valid, other=0)
        own, peer = valid & (src == rank), valid & (src != rank)
        w = tl.load(own_weight_ptr + pos, mask=own, other=0.0)
        w += tl.load(copied_weight_ptr + src.to(tl.int64) * stage_slots + pos, mask=peer, other=0.0)
    else:
        w = tl.load(copied_weight_ptr + rows, mask=valid, other=0.0)
    tl.store(out_ptr + rows, w.to(out_ptr.dtype.element_ty), mask=rows < P)


@triton.jit(do_not_specialize=["rank", "G", "P", "stage_rows", "stage_slots"])
def _pool_tokens_kernel(
    row_src_ptr, row_pos_ptr, expert_start_ptr, send_token_ptr, bcast_tok_ptr, out_ptr, rank, G, P, stage_rows,
    stage_slots, BLOCK: tl.constexpr,
):  # fmt: skip
    """Broadcast mode: each pool row's row in the broadcast copies ``[W * stage_rows, H]`` (source rank
    times ``stage_rows`` plus its token there; 0 past the valid rows). Own rows' tokens come from this
    rank's send order, a peer's from the copy it made of its own (valid once its flags arrived)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < tl.load(expert_start_ptr + G)
    src = tl.load(row_src_ptr + rows, mask=valid, other=0)
    pos = tl.load(row_pos_ptr + rows, mask=valid, other=0)
    own, peer = valid & (src == rank), valid & (src != rank)
    token = tl.load(send_token_ptr + pos, mask=own, other=0)
    token += tl.load(bcast_tok_ptr + src.to(tl.int64) * stage_slots + pos, mask=peer, other=0)
    tl.store(out_ptr + rows, src * stage_rows + token, mask=rows < P)


@triton.jit
def peer_ptr(local_ptr, bases, rank, r):
    """``local_ptr`` moved into rank ``r``'s copy of the workspace.

    Buffer bases are page-aligned, so the shift is a multiple of 16 elements; saying so keeps the
    compiler's 16-byte vector loads and stores (an address cast from an integer would get 2-byte ones).
    """
    elem = local_ptr.dtype.element_ty.primitive_bitwidth // 8
    delta = (tl.load(bases + r) - tl.load(bases + rank)) // elem
    return local_ptr + tl.multiple_of(delta, 16)


@triton.jit
def _copy_rows(src_ptr, src_rows, dst_ptr, dst_rows, ok, H, COPY_COLS: tl.constexpr):
    """``dst[dst_rows] = src[src_rows]`` for the rows where ``ok``, ``H`` columns each."""
    cols = tl.arange(0, COPY_COLS)
    for c0 in range(0, H, COPY_COLS):
        c = c0 + cols
        mask = ok[:, None] & (c < H)[None, :]
        v = tl.load(src_ptr + src_rows[:, None] * H + c[None, :], mask=mask)
        tl.store(dst_ptr + dst_rows[:, None] * H + c[None, :], v, mask=mask)


@triton.jit
def _comm_share(pid, num_comm, world):
    """The peers this comm program serves (``range(first, world, step)`` of offsets from this rank) and
    its index ``q`` among the ``Q`` programs that split each (peer, expert) task's rows.

    With at least one program per peer, each peer gets ``Q = num_comm // world`` programs that walk
    its experts in order, each copying every Q-th chunk: the first experts land after a fraction of
    the exchange instead of all experts landing together. With fewer (the CPU interpreter runs one),
    a program serves several peers alone.
    """
    many = num_comm >= world
    Q = tl.maximum(num_comm // world, 1)
    q = tl.where(many, pid // world, 0)
    first = tl.where(many, pid % world, pid)
    first = tl.where(q < Q, first, world)  # left over when num_comm is not a multiple of world
    step = tl.where(many, world, num_comm)
    return first, step, q, Q


@triton.jit
def _task_done(task_done_ptr, index, Q):
    """Count this program out of task ``index``; true for the last of its ``Q`` programs.

    Release/acquire at system scope: the last one's signal then covers every program's stores.
    """
    tl.debug_barrier()
    return tl.atomic_add(task_done_ptr + index, 1, sem="acq_rel", scope="sys") == Q - 1


@triton.jit
def _push_rows(
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
    PUSH_WEIGHT: tl.constexpr,
    LOCAL_A: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    COPY_COLS: tl.constexpr,
):
    """Comm role: copy my rows of every (expert, destination) into the destination's pool, then signal."""
    rows = tl.arange(0, COPY_ROWS)
    first, step, q, Q = _comm_share(pid, num_comm, world)
    for d_off in range(first, world, step):
        d = (rank + d_off) % world
        pool = peer_ptr(pool_ptr, bases, rank, d)
        for g in range(G):
            _push_task(
                d,
                d * G + g,
                g,
                q,
                Q,
                epoch,
                bases,
                rank,
                G,
                pool_rows,
                pool,
                src_ptr,
                send_token_ptr,
                send_slot_ptr,
                send_weight_ptr,
                send_start_ptr,
                send_dest_row_ptr,
                H,
                pool_w_ptr,
                pool_ready_ptr,
                task_done_ptr,
                rows,
                PUSH_WEIGHT,
                LOCAL_A,
                COPY_ROWS,
                COPY_COLS,
            )


@triton.jit
def _push_task(
    d,
    e,
    g,
    q,
    Q,
    epoch,
    bases,
    rank,
    G,
    pool_rows,
    pool,
    src_ptr,
    send_token_ptr,
    send_slot_ptr,
    send_weight_ptr,
    send_start_ptr,
    send_dest_row_ptr,
    H,
    pool_w_ptr,
    pool_ready_ptr,
    task_done_ptr,
    rows,
    PUSH_WEIGHT: tl.constexpr,
    LOCAL_A: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    COPY_COLS: tl.constexpr,
):
    """Every Q-th chunk (from the q-th) of my rows of expert ``e`` into rank d's pool; the last of the
    Q programs releases ``pool_ready[me, g]`` there."""
    s0 = tl.load(send_start_ptr + e)
    s1 = tl.load(send_start_ptr + e + 1)
    dest0 = tl.load(send_dest_row_ptr + e)
    for p0 in range(s0 + q * COPY_ROWS, s1, Q * COPY_ROWS):
        pos = p0 + rows
        dest = dest0 + pos - s0
        ok = (pos < s1) & (dest < pool_rows)
        token = tl.load(send_token_ptr + pos, mask=ok, other=0).to(tl.int64)
        dest64 = dest.to(tl.int64)
        if (d != rank) | (LOCAL_A == 0):
            _copy_rows(src_ptr, token, pool, dest64, ok, H, COPY_COLS)
        if PUSH_WEIGHT:
            slot = tl.load(send_slot_ptr + pos, mask=ok, other=0)
            w = tl.load(send_weight_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            tl.store(peer_ptr(pool_w_ptr, bases, rank, d) + dest64, w, mask=ok)
    if _task_done(task_done_ptr, e, Q):
        tl.atomic_xchg(
            peer_ptr(pool_ready_ptr, bases, rank, d) + rank * G + g, epoch, sem="release", scope="sys"
        )


@triton.jit
def _pull_rows(
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
    PUSH_WEIGHT: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    COPY_COLS: tl.constexpr,
):
    """Comm role, pull mode: copy every source's rows of my experts from its staging area into my pool."""
    rows = tl.arange(0, COPY_ROWS)
    bank = epoch % 2
    first, step, q, Q = _comm_share(pid, num_comm, world)
    for s_off in range(first, world, step):
        s = (rank + s_off) % world
        stage_x = peer_ptr(stage_x_ptr, bases, rank, s) + bank.to(tl.int64) * stage_rows * H
        stage_tok = peer_ptr(stage_tok_ptr, bases, rank, s) + bank * stage_slots
        stage_w = peer_ptr(stage_w_ptr, bases, rank, s) + bank * stage_slots
        for g in range(G):
            seg0 = tl.load(seg_start_ptr + g * world + s)
            n = tl.load(seg_len_ptr + g * world + s)
            pos0 = tl.load(seg_pos_ptr + g * world + s)
            for j0 in range(q * COPY_ROWS, n, Q * COPY_ROWS):
                j = j0 + rows
                dest = seg0 + j
                ok = (j < n) & (dest < pool_rows)
                token = tl.load(stage_tok + pos0 + j, mask=ok, other=0).to(tl.int64)
                dest64 = dest.to(tl.int64)
                _copy_rows(stage_x, token, pool_ptr, dest64, ok, H, COPY_COLS)
                if PUSH_WEIGHT:
                    w = tl.load(stage_w + pos0 + j, mask=ok, other=0.0)
                    tl.store(pool_w_ptr + dest64, w, mask=ok)
            if _task_done(task_done_ptr, s * G + g, Q):
                tl.atomic_xchg(pool_ready_ptr + s * G + g, epoch, sem="release", scope="sys")


@triton.jit
def _gemm_tile(
    tile_id, ready_expert, epoch, bases, rank, world, G, num_m, num_local, num_n, src_ptr, send_token_ptr,
    a_ptr, b_desc, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr, row_pos_ptr, tiles_ptr,
    state_ptr, pool_ready_ptr, comb_ptr, comb_scalar_ptr, N, K, H, stride_a, stride_c, max_spins,
    bcast_x_ptr, bcast_tok_ptr, stage_rows, stage_slots,
    WAIT: tl.constexpr, LOCAL_A: tl.constexpr, OUT_REMOTE: tl.constexpr, ROW_SCALE: tl.constexpr,
    PUSH_SCALAR: tl.constexpr, SKIP_MMA: tl.constexpr, B_KN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLAT: tl.constexpr = False,
    IN_PTX: tl.constexpr = False, BCAST_A: tl.constexpr = False, SPREAD: tl.constexpr = False,
):  # fmt: skip
    """GEMM role, one tile: [wait for its expert's rows,] ``A[rows] @ B[expert]``, store locally or remotely.

    Returns the expert whose rows are known to have landed (consecutive tiles mostly share one, so
    its flags are polled once for them; with ``FLAT``, expert + G after a tile of own rows).
    ``LOCAL_A``: rows from this rank are read from ``src`` by token (the comm role did not copy them
    into the pool), and the table's first ``num_local`` tiles, which hold only those, wait for
    nothing. ``FLAT``: waits without branches or Triton loops, for a flattened tile loop (``IN_PTX``:
    the poll loop in inline PTX). ``SPREAD`` (remote outputs): the table's first ``num_local`` tiles,
    whose rows came from this rank and whose outputs stay here, are taken in even proportion with the
    tiles whose outputs cross NVLink, so those stores are spread over the whole GEMM rather than left
    for its second half.
    """
    pid_m, pid_n = _swizzle(tile_id, num_m, num_n, GROUP_M)
    if SPREAD:  # the table's first num_local tiles (own rows: local stores) spread evenly among the rest
        before = (pid_m * num_local) // num_m
        pid_m = tl.where(((pid_m + 1) * num_local) // num_m > before, before, num_local + pid_m - before)
    expert = tl.load(tiles_ptr + 3 * pid_m)
    r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
    r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
    own_only = (pid_m < num_local) & LOCAL_A  # only my own rows (read from x): it awaits nothing
    if WAIT and FLAT:
        # no branch and no Triton loop (so the tile loop can be flattened): one wait per source up to
        # MAX_FLAT_WORLD, each a no-op unless needed. An own-rows tile remembers expert + G, which no
        # later tile's rows match. (Keeping the previous expert instead, a select on the loop-carried
        # value, made Triton 3.6 pipeline the flattened loop one stage shallower: 2.5x slower.)
        key = expert + tl.where(own_only, G, 0)
        for s in tl.static_range(_MAX_FLAT_WORLD):
            need = (s < world) & (key != ready_expert) & ~own_only & ((s != rank) | (LOCAL_A == 0))
            src = tl.minimum(s, world - 1)
            _wait_flag(
                pool_ready_ptr + src * G + expert, epoch, need, state_ptr, rank, _POOL, src * G + expert,
                max_spins, IN_PTX,
            )  # fmt: skip
        ready_expert = key
    elif WAIT:  # noqa: SIM102 (compile-time branch)
        if (expert != ready_expert) & ~own_only:
            for s in range(world):
                if (s != rank) | (LOCAL_A == 0):
                    _spin_until(
                        pool_ready_ptr + s * G + expert, epoch, state_ptr, rank, _POOL, s * G + expert,
                        max_spins,
                    )  # fmt: skip
            ready_expert = expert
    n0 = pid_n * BLOCK_N
    offs_m = r0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < r_end
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    if LOCAL_A:  # two dependent loads before the row addresses: (source, send position), then token
        row_src = tl.load(row_src_ptr + offs_m, mask=mask_m, other=0)
        pos = tl.load(row_pos_ptr + offs_m, mask=mask_m, other=0)
        local = mask_m & (row_src == rank)
        token = tl.load(send_token_ptr + pos, mask=local, other=0).to(tl.int64)
        a_ptrs = tl.where(local[:, None], src_ptr + token[:, None] * H + offs_k[None, :], a_ptrs)
        if BCAST_A:  # a peer's row: from the copy of its x in this rank's workspace, by its token
            remote = mask_m & (row_src != rank)
            rtok = tl.load(bcast_tok_ptr + row_src * stage_slots + pos, mask=remote, other=0)
            rrow = row_src.to(tl.int64) * stage_rows + rtok.to(tl.int64)
            a_ptrs = tl.where(remote[:, None], bcast_x_ptr + rrow[:, None] * H + offs_k[None, :], a_ptrs)
    k_extent = 0 if SKIP_MMA else K
    acc = tile_product(
        a_ptrs, None, r0, mask_m, b_desc, expert, n0, k_extent, False, B_KN, BLOCK_M, BLOCK_N, BLOCK_K
    )
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    if OUT_REMOTE:
        src = tl.load(row_src_ptr + offs_m, mask=mask_m, other=0)
        pos = tl.load(row_pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        # each row to its source's copy of the combine slots: local pointer + the peer's shift
        # (page-aligned bases, N % 8 == 0: the hint keeps 16-byte stores)
        shift = tl.load(bases + src, mask=mask_m, other=0) - tl.load(bases + rank)
        elem = comb_ptr.dtype.element_ty.primitive_bitwidth // 8
        row = tl.multiple_of(shift // elem + pos * N, 8)
        tl.store(comb_ptr + row[:, None] + offs_n[None, :], acc.to(comb_ptr.dtype.element_ty), mask=mask)
        if PUSH_SCALAR:  # the first column tile sends it (a mask, not a branch: see FLAT)
            first_n = mask_m & (pid_n == 0)
            v = tl.load(scalar_ptr + offs_m, mask=first_n, other=0.0).to(tl.float32)
            tl.store(comb_scalar_ptr + shift // 4 + pos, v, mask=first_n)
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    return ready_expert


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
def _fused_kernel(
    # comm role
    src_ptr,
    send_token_ptr,
    send_slot_ptr,
    send_weight_ptr,
    send_start_ptr,
    send_dest_row_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_pos_ptr,
    # GEMM role
    a_ptr,
    b_desc,
    c_ptr,
    row_scale_ptr,
    scalar_ptr,
    row_src_ptr,
    row_pos_ptr,
    tiles_ptr,
    num_tiles_ptr,
    num_local_tiles_ptr,
    # workspace
    ptrs_dev,
    state_ptr,
    pool_ready_ptr,
    rank,
    world,
    G,
    pool_rows,
    pool_ptr,
    pool_w_ptr,
    comb_ptr,
    comb_scalar_ptr,
    comb_ready_ptr,
    stage_x_ptr,
    stage_tok_ptr,
    stage_w_ptr,
    task_done_ptr,
    bcast_x_ptr,
    bcast_tok_ptr,
    # sizes
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
    SKIP_MMA: tl.constexpr,
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
    TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    if TRACE:
        _trace(trace_ptr, pid, 0, _now(pid, IN_PTX))
    epoch = tl.load(state_ptr)
    bases = ptrs_dev.to(tl.pointer_type(tl.int64))
    if COMM:  # noqa: SIM102 (compile-time branch: the runtime test must not join it)
        if pid < num_comm:
            if PULL:
                _pull_rows(
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
                _push_rows(
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
    if TRACE:
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
            ready_expert = _gemm_tile(
                tile_id, ready_expert, epoch, bases, rank, world, G, num_m, num_local, num_n, src_ptr,
                send_token_ptr, a_ptr, b_desc, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr,
                row_pos_ptr, tiles_ptr, state_ptr, pool_ready_ptr, comb_ptr, comb_scalar_ptr, N, K, H,
                stride_a, stride_c, max_spins, bcast_x_ptr, bcast_tok_ptr, stage_rows, stage_slots, WAIT,
                LOCAL_A, OUT_REMOTE, ROW_SCALE, PUSH_SCALAR, SKIP_MMA, B_KN, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, FLAT, IN_PTX, BCAST_A, SPREAD,
            )  # fmt: skip
    if TRACE:
        _trace(trace_ptr, pid, 2, _now(pid, IN_PTX))
    counter_tiles = 0
    if COMM:
        tile_id = num_static + tl.atomic_add(state_ptr + _TILE, 1)
        while tile_id < total:
            if TRACE:
                counter_tiles += 1
            ready_expert = _gemm_tile(
                tile_id, ready_expert, epoch, bases, rank, world, G, num_m, num_local, num_n, src_ptr,
                send_token_ptr, a_ptr, b_desc, c_ptr, row_scale_ptr, scalar_ptr, row_src_ptr,
                row_pos_ptr, tiles_ptr, state_ptr, pool_ready_ptr, comb_ptr, comb_scalar_ptr, N, K, H,
                stride_a, stride_c, max_spins, bcast_x_ptr, bcast_tok_ptr, stage_rows, stage_slots, WAIT,
                LOCAL_A, OUT_REMOTE, ROW_SCALE, PUSH_SCALAR, SKIP_MMA, B_KN, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, FLAT, IN_PTX, BCAST_A, SPREAD,
            )  # fmt: skip
            tile_id = num_static + tl.atomic_add(state_ptr + _TILE, 1)
    if TRACE:
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
