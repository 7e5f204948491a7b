"""Weighted top-k combine: ``y[t] = sum_k w[row(t, k)] * rows[row(t, k)]``, a deterministic gather-reduce.

Legend: T tokens, K top-k, H columns, R expert-sorted rows.

    for (t, h_block) in grid:
        acc = 0                                   # float32
        for k in range(K):                        # fixed order: the same bits on every run
            r = slot_row[t * K + k]
            if r >= 0: acc += w[r] * rows[r, h_block]   (w = 1 without weights)
        y[t, h_block] = acc

It follows the grouped GEMM instead of living in its epilogue: an epilogue scatter would need float
atomics (a different sum order each run), and one extra pass over the rows is a few percent of GEMM2.
The same kernel reduces the dgrad rows into ``dx`` in backward (no weights there), and there also carries
the routing-weight gradient from the rows back to the slots, whose rows it reads anyway: no launch of
its own for that.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.routing import pick_slot_value


@triton.jit
def _combine_kernel(
    rows_ptr,
    slot_row_ptr,
    weight_ptr,
    out_ptr,
    row_values_ptr,
    slot_values_ptr,
    H,
    stride_rows,
    stride_out,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(slot_row_ptr + t * K + k)
        if row_values_ptr is not None:
            pick_slot_value(row_values_ptr, r, slot_values_ptr, t * K + k, tl.program_id(1) == 0)
        if r >= 0:
            v = tl.load(rows_ptr + r.to(tl.int64) * stride_rows + offs, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(weight_ptr + r).to(tl.float32)
            acc += v
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(
    rows_RH: Tensor,
    slot_row_S: Tensor,
    out_TH: Tensor,
    *,
    topk: int,
    weights_R: Tensor | None,
    to_slots: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Write ``out_TH`` from the expert-sorted ``rows_RH`` (``weights_R`` scales each row first). Either may
    be a column range of a wider tensor (rows strided, columns contiguous). ``to_slots = (values_R,
    out_S)``: also write ``out_S[s] = values_R[slot_row_S[s]]`` (0 for a dropped slot), what
    :func:`~.routing.pick_slots` writes."""
    T, H = out_TH.shape
    if T == 0:
        return
    if rows_RH.shape[1] != H or rows_RH.stride(1) != 1 or out_TH.stride(1) != 1:
        raise ValueError(
            f"rows {tuple(rows_RH.shape)} (strides {rows_RH.stride()}) into out {tuple(out_TH.shape)} "
            f"(strides {out_TH.stride()}): both need H={H} contiguous columns"
        )
    block_h = min(next_power_of_2(H), 2048)
    _combine_kernel[(T, cdiv(H, block_h))](
        rows_RH,
        slot_row_S,
        weights_R,
        out_TH,
        *(to_slots or (None, None)),
        H,
        rows_RH.stride(0),
        out_TH.stride(0),
        K=topk,
        WEIGHTED=weights_R is not None,
        BLOCK_H=block_h,
        num_warps=4 if block_h <= 1024 else 8,
    )
