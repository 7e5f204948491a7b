"""Triton code of the fused EP path that moves rows: the comm role of the fused kernel (push and pull),
and broadcast mode's helpers (the pool gathered from peers' copies, the pool rows' weights and tokens).

Peers are reached through the workspace's table of buffer bases (``buffer_ptrs_dev``): a peer's region
is ``base[r] + offset`` (:func:`~megamoe.backends.triton.peers.peer_ptr`), loaded and stored like local
memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.backends.symm.signals import POOL_ID, spin_until
from megamoe.backends.triton.peers import peer_ptr
from megamoe.backends.triton.side_gather import copy_rows_streaming


@triton.jit
def copy_rows(src_ptr, src_rows, dst_ptr, dst_rows, ok, H, COPY_COLS: tl.constexpr):
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
def push_rows(
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
            copy_rows(src_ptr, token, pool, dest64, ok, H, COPY_COLS)
        if PUSH_WEIGHT:
            slot = tl.load(send_slot_ptr + pos, mask=ok, other=0)
            w = tl.load(send_weight_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            tl.store(peer_ptr(pool_w_ptr, bases, rank, d) + dest64, w, mask=ok)
    if _task_done(task_done_ptr, e, Q):
        tl.atomic_xchg(
            peer_ptr(pool_ready_ptr, bases, rank, d) + rank * G + g, epoch, sem="release", scope="sys"
        )


@triton.jit
def pull_rows(
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
                copy_rows(stage_x, token, pool_ptr, dest64, ok, H, COPY_COLS)
                if PUSH_WEIGHT:
                    w = tl.load(stage_w + pos0 + j, mask=ok, other=0.0)
                    tl.store(pool_w_ptr + dest64, w, mask=ok)
            if _task_done(task_done_ptr, s * G + g, Q):
                tl.atomic_xchg(pool_ready_ptr + s * G + g, epoch, sem="release", scope="sys")


@triton.jit(
    do_not_specialize=["rank", "world", "G", "stage_rows", "stage_slots", "num_programs", "max_spins"]
)
def gather_broadcast_rows_kernel(
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
            spin_until(pool_ready_ptr + s * G, epoch, state_ptr, rank, POOL_ID, s * G, max_spins)
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
def pool_weights_kernel(
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
def pool_tokens_kernel(
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


@triton.jit(do_not_specialize=["rank", "world", "num_programs"])
def return_rows_kernel(
    rows_ptr, valid_ptr, row_scale_ptr, scalar_ptr, row_src_ptr, row_pos_ptr, combine_ptr, combine_scalar_ptr,
    combine_ready_ptr, epoch_ptr, done_ptr, ptrs_dev, rank, world, H, N, col0, stride_rows, num_programs,
    ROW_SCALE: tl.constexpr, PUSH_SCALAR: tl.constexpr, SIGNAL: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Each valid pool row ``r`` (``< valid``) home, for expert GEMMs without a remote epilogue: its ``N``
    columns into columns ``[col0, col0 + N)`` of ``combine[pos[r]]`` on rank ``src[r]`` (times
    ``row_scale[r]``, in fp32, with ``ROW_SCALE``), and ``scalar[r]`` into ``combine_scalar[pos[r]]``
    there (``PUSH_SCALAR``). ``SIGNAL``: the last program out releases ``combine_ready[rank]`` on every
    rank, once every program's stores are visible (as the GEMMs' remote epilogues do)."""
    valid = tl.load(valid_ptr)
    bases = ptrs_dev.to(tl.pointer_type(tl.int64))
    elem = combine_ptr.dtype.element_ty.primitive_bitwidth // 8
    for r0 in range(tl.program_id(0) * BLOCK_R, valid, num_programs * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < valid
        src = tl.load(row_src_ptr + rows, mask=ok, other=0)
        pos = tl.load(row_pos_ptr + rows, mask=ok, other=0).to(tl.int64)
        shift = tl.load(bases + src, mask=ok, other=0) - tl.load(bases + rank)
        # page-aligned bases, H and col0 multiples of 16 (the FP8 widths, 128-column ranges): 16-byte stores
        dst = tl.multiple_of(shift // elem + pos * H + col0, 8)
        if ROW_SCALE:
            scale = tl.load(row_scale_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = ok[:, None] & (cols < N)[None, :]
            v = tl.load(rows_ptr + rows.to(tl.int64)[:, None] * stride_rows + cols[None, :], mask=mask)
            if ROW_SCALE:
                v = v.to(tl.float32) * scale[:, None]
            tl.store(
                combine_ptr + dst[:, None] + cols[None, :], v.to(combine_ptr.dtype.element_ty), mask=mask
            )
        if PUSH_SCALAR:
            v = tl.load(scalar_ptr + rows, mask=ok, other=0.0)
            tl.store(combine_scalar_ptr + shift // 4 + pos, v, mask=ok)
    if SIGNAL:
        tl.debug_barrier()
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == num_programs - 1:
            tl.store(done_ptr, 0)
            epoch = tl.load(epoch_ptr)
            for r in range(world):
                tl.atomic_xchg(
                    peer_ptr(combine_ready_ptr, bases, rank, r) + rank, epoch, sem="release", scope="sys"
                )
