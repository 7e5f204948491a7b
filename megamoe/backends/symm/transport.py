"""The symmetric workspace's row movement for expert GEMMs that do not wait for rows per tile.

Legend: T tokens, H hidden, K top-k, P pool rows (expert-major, rows past ``expert_start[G]`` are padding).

For expert backends whose GEMMs start once all their rows arrived (the MXFP8 and FP8 kernels): the
rows routed to this rank are made readable first, by row index from the broadcast copies or in pool
order from a filled pool; the GEMM that makes the expert outputs sends each row to its source's
combine slot from its epilogue and releases ``combine_ready`` (as the bf16 fused kernel does; MXFP8),
or writes them here and :func:`return_rows` sends them (FP8), and the source sums over K. It uses the
fused path's workspace, layout, ops and signals (each step one op, its barrier first), so it needs no
host sync and captures in a CUDA graph; the dispatch does not overlap with the GEMMs::

    op start        [pull mode: stage src_TH] barrier (stage 1: with the count exchange and the layout)
    dispatch_rows   broadcast mode: copy src_TH to every peer (copy engines) and into this rank's own
                    slot, wait, each pool row's index into the copies; push and pull mode: the fused
                    kernel's comm role alone fills the pool; wait
    ...             the backend's GEMMs; the last one stores its rows at their sources, or
    return_rows     sends the rows it wrote home (one launch)
    wait_returned   every peer's rows for this rank landed
    combine_rows    y[t] = sum_k combine[slot (t, k)]   (fixed order, fp32)
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.symm import backend as fused
from megamoe.backends.symm import launch
from megamoe.backends.symm.backend import SymmPlan
from megamoe.backends.symm.workspace import COUNTER_COMBINE, COUNTER_POOL
from megamoe.backends.triton.combine import combine


def begin(plan: SymmPlan, src_TH: Tensor | None = None) -> None:
    """Start an op after stage 1; with ``src_TH``, one that will :func:`dispatch_rows` from it (pull mode
    stages its rows before the barrier)."""
    fused.begin(plan, None if src_TH is None else fused.rows_to_move(plan, src_TH))


def dispatch_rows(
    plan: SymmPlan, src_TH: Tensor, weights_TK: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """After the op's start: ``(rows, index_P, weights_P)``, where this rank's pool row r is
    ``rows[index_P[r]]``, or ``rows[r]`` when ``index_P`` is None; with ``weights_TK``, each pool row's
    routing weight (``[P]``, 0 past the valid rows).

    Broadcast mode: ``rows`` are every rank's ``src_TH`` side by side in this workspace's copies
    (``[W * T_max, H]``; this rank's copied in locally), so no pool is filled and a quantiser reads each
    token once. Push and pull mode: ``rows`` is the pool, filled by the fused kernel's comm role alone.
    Every rank sends whatever it needs itself, since its peers wait for its rows.

    ``src_TH`` may be narrower than the workspace's rows (H elements of its dtype): rows of that width
    move and land packed (:func:`~megamoe.backends.symm.workspace.narrow_rows`), e.g. quantised rows
    and their scales, viewed in the workspace's dtype."""
    ws, lay, s, width = plan.ws, plan.layout, plan.send, src_TH.shape[1]
    send_weight_S = None
    if ws.dispatch == "broadcast":
        if weights_TK is not None:
            send_weight_S = s.row_values_R(weights_TK).float()
        launch.broadcast_rows(ws, src_TH, s.row_token_R, send_weight_S)
        copies, own = ws.view("bcast_x", width), ws.rank * ws.max_tokens
        copies[own : own + src_TH.shape[0]].copy_(src_TH)
        ws.view("pool_ready")[ws.rank].copy_(ws.signal_G)  # own flags too: one wait covers every source
        launch.wait_flags(ws, "pool_ready", COUNTER_POOL)
        launch.join_broadcast(ws)
        rows, index = copies, launch.pool_tokens(ws, lay, s.row_token_R)
    else:
        launch.push_rows(ws, fused.rows_to_move(plan, src_TH, weights_TK))
        launch.wait_flags(ws, "pool_ready", COUNTER_POOL)
        rows, index = ws.view("pool", width), None
    weights = None if weights_TK is None else launch.pool_weights(ws, lay, send_weight_S, weights_TK.dtype)
    return rows, index, weights


def return_rows(
    plan: SymmPlan,
    rows_PN: Tensor,
    *,
    first_column: int = 0,
    row_scale_P: Tensor | None = None,
    scalar_P: Tensor | None = None,
    last: bool = True,
) -> None:
    """After a GEMM that wrote this rank's pool rows ``[P, N]`` here: each valid row into columns
    ``first_column`` on of its source's combine slot (times ``row_scale_P``, with ``scalar_P`` beside
    it). ``last``: the op's last call (every rank makes one, also without rows), which releases
    ``combine_ready`` for :func:`wait_returned`."""
    launch.return_rows(
        plan.ws,
        plan.layout,
        rows_PN,
        first_column=first_column,
        row_scale_P=None if row_scale_P is None else row_scale_P.contiguous(),
        scalar_P=None if scalar_P is None else scalar_P.float().contiguous(),
        signal=last,
    )


def wait_returned(plan: SymmPlan) -> None:
    """After a GEMM that sent its rows to their sources (``combine_ready`` released by every rank):
    every peer's rows for this rank have landed in its combine slots."""
    launch.wait_flags(plan.ws, "combine_ready", COUNTER_COMBINE)


def combine_rows(plan: SymmPlan) -> Tensor:
    """After :func:`wait_returned`: ``y [T, H] = sum_k combine[slot (t, k)]`` (fp32 sums, the rows' dtype)."""
    s, rows = plan.send, plan.ws.view("combine")
    y = rows.new_empty(s.num_tokens, rows.shape[1])
    combine(rows, s.slot_row_S, y, topk=s.topk, weights_R=None)
    return y


def returned_scalars(plan: SymmPlan, dtype: torch.dtype) -> Tensor:
    """After :func:`wait_returned`: each (token, k) slot's scalar, ``[T, K]``."""
    return plan.send.slot_values_TK(plan.ws.view("combine_scalar")).to(dtype)
