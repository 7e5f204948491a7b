"""Triton signals of the fused EP path: the op barrier, waits on flags, and how a bounded wait fails.

Signals are release stores of the op epoch at system scope; waits poll with acquire loads until
``>= epoch``, so nothing is reset between ops. A bounded wait (debug mode) records what it waited on
in the workspace state and gives up instead of hanging. Rank-dependent integers and the wait bound
are not specialised, so every rank runs the same compiled kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.backends.symm.workspace import COUNTER_ARRIVE, COUNTER_POOL, STATE_ERROR
from megamoe.backends.triton.peers import peer_ptr

ERROR_SLOT = tl.constexpr(STATE_ERROR)
ARRIVE_ID = tl.constexpr(COUNTER_ARRIVE)
POOL_ID = tl.constexpr(COUNTER_POOL)


@triton.jit
def spin_until(ptr, expected, state_ptr, rank, counter_id, index, max_spins):
    """Acquire-poll ``*ptr`` until ``>= expected``; after ``max_spins`` polls record the failure and return."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < expected) & (spins < max_spins):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        spins += 1
    record_timeout(seen, expected, state_ptr, rank, counter_id, index)


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
def wait_flag(ptr, expected, need, state_ptr, rank, counter_id, index, max_spins, IN_PTX: tl.constexpr):
    """:func:`spin_until` if ``need``, without a branch (so a flattened tile loop may hold it): the poll
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
        record_timeout(seen, expected, state_ptr, rank, counter_id, index)
    else:
        spin_until(ptr, tl.where(need, expected, -2147483647), state_ptr, rank, counter_id, index, max_spins)


@triton.jit
def record_timeout(seen, expected, state_ptr, rank, counter_id, index):
    """If a wait gave up, keep the first failure in the workspace state (:meth:`SymmWorkspace.check`)."""
    if seen < expected:
        first = tl.atomic_cas(state_ptr + ERROR_SLOT, 0, 1) == 0  # keep the first failure
        if first:
            tl.store(state_ptr + ERROR_SLOT + 1, rank)
            tl.store(state_ptr + ERROR_SLOT + 2, counter_id)
            tl.store(state_ptr + ERROR_SLOT + 3, index)
            tl.store(state_ptr + ERROR_SLOT + 4, seen)
            tl.store(state_ptr + ERROR_SLOT + 5, expected)


@triton.jit(do_not_specialize=["rank", "world", "E", "G", "max_spins"])
def barrier_kernel(
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
        spin_until(arrive_ptr + s, epoch, state_ptr, rank, ARRIVE_ID, s, max_spins)


@triton.jit(do_not_specialize=["n", "rank", "max_spins"])
def wait_kernel(flags_ptr, n, state_ptr, rank, counter_id, max_spins):
    """Wait until every one of ``flags[0:n]`` reached this op's epoch."""
    epoch = tl.load(state_ptr)
    for i in range(n):
        spin_until(flags_ptr + i, epoch, state_ptr, rank, counter_id, i, max_spins)
