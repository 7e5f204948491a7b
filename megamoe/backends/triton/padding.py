"""Zero the padding rows of ``[R, N]`` row buffers: rows ``>= expert_start[G]`` carry no routed slot.

The plan has static shapes (R = T*K rows) so that nothing syncs with the host; dropped slots sort to
the end and no GEMM tile covers them. This kernel gives those rows defined values (zeros) at the cost
of one launch (for up to two buffers of the same rows) that exits at once when nothing was dropped; the
bf16 GEMM1 zeroes its outputs' padding rows in its own programs instead (:func:`zero_rows`). The
quantised GEMM1s also have it pick each row's routing weight, which would take a launch of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.routing import pick_row_values


@triton.jit
def zero_rows(out_ptr, rows, mask_r, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zero the rows ``rows`` (where ``mask_r``) of the contiguous ``[*, N]`` buffer at ``out_ptr``."""
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        zeros = tl.zeros((BLOCK_R, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(ptrs, zeros, mask=mask_r[:, None] & (cols[None, :] < N))


@triton.jit
def _zero_padding_rows_kernel(
    a_ptr,
    b_ptr,
    valid_rows_ptr,
    slot_values_ptr,
    row_slot_ptr,
    row_values_ptr,
    R,
    NA,
    NB,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    valid = tl.load(valid_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    rows = r0 + tl.arange(0, BLOCK_R)
    if r0 + BLOCK_R > valid:
        mask_r = (rows >= valid) & (rows < R)
        zero_rows(a_ptr, rows, mask_r, NA, BLOCK_R, BLOCK_N)
        zero_rows(b_ptr, rows, mask_r, NB, BLOCK_R, BLOCK_N)
    if row_values_ptr is not None:
        pick_row_values(slot_values_ptr, row_slot_ptr, row_values_ptr, rows, valid, R)


def zero_padding_rows(
    expert_start_G1: Tensor,
    a_RN: Tensor,
    b_RM: Tensor | None = None,
    *,
    row_values: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Zero rows ``expert_start_G1[-1]:`` of the contiguous ``a_RN`` (and of ``b_RM``, same rows) without
    reading the count on the host. ``row_values = (values_S, row_slot_R, out_R)``: the same launch also
    writes what :func:`~.routing.pick_rows` would, ``out_R[r] = values_S[row_slot_R[r]]``, 0 on padding
    rows (the quantised GEMM1's routing weights, as the bf16 GEMM1's programs pick them)."""
    R, N = a_RN.shape
    M = 0 if b_RM is None else b_RM.shape[1]
    if R == 0 or (N == M == 0 and row_values is None):
        return
    block_r = 32
    _zero_padding_rows_kernel[(cdiv(R, block_r),)](
        a_RN, a_RN if b_RM is None else b_RM, expert_start_G1[-1:], *(row_values or (None, None, None)),
        R, N, M, BLOCK_R=block_r, BLOCK_N=min(next_power_of_2(max(N, M, 16)), 256),
    )  # fmt: skip
