"""One output tile of the fused EP kernel's GEMM role: wait for its rows, ``A[rows] @ B[expert]``, store.

The rows come from the pool, from this rank's own ``x`` by token (``LOCAL_A``), or from a peer's
broadcast copy (``BCAST_A``); the output goes to local memory or to each row's source rank
(``OUT_REMOTE``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.backends.symm.signals import POOL_ID, spin_until, wait_flag
from megamoe.backends.triton.grouped_gemm import _swizzle, tile_product

MAX_FLAT_WORLD = 8
"""largest EP group whose waits the flattened tile loop unrolls (larger groups claim every tile)"""
_MAX_FLAT_WORLD = tl.constexpr(MAX_FLAT_WORLD)


@triton.jit
def gemm_tile(
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
            wait_flag(
                pool_ready_ptr + src * G + expert, epoch, need, state_ptr, rank, POOL_ID, src * G + expert,
                max_spins, IN_PTX,
            )  # fmt: skip
        ready_expert = key
    elif WAIT:  # noqa: SIM102 (compile-time branch)
        if (expert != ready_expert) & ~own_only:
            for s in range(world):
                if (s != rank) | (LOCAL_A == 0):
                    spin_until(
                        pool_ready_ptr + s * G + expert, epoch, state_ptr, rank, POOL_ID, s * G + expert,
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
