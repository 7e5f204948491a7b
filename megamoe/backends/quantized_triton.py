"""Quantised Triton expert backends (``mxfp8``, ``fp8``): an expert-math part over a transport.

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R = T*K expert-sorted rows
(dropped slots padded at the end).

The expert math is :class:`~megamoe.backends.triton_mx.experts.MXExperts` (OCP MX, per-32 scales) or
:class:`~megamoe.backends.triton_fp8.experts.FP8Experts` (DeepSeek-V3's blockwise FP8, per-128
promotion): each quantises inside its producers (the rowwise quantiser at the source, the SwiGLU
passes, the along-R segment quantisers) and runs its E4M3 GEMMs, with weights from its
:class:`~megamoe.quant.cache.WeightCache` (refreshed per optimizer step). The emulation's table
(:mod:`megamoe.backends.quantized_reference`) says which operand is quantised how.

    stage 1 fwd   q(x) rowwise at the source [T, H]; h = q(x)[row_token] q(W1)^T   (dispatch = row gather)
    stage 2 fwd   q(a) from the SwiGLU pass; o = q(a) q(W2)^T; y = sum_k w o (fp32)   the bf16 path's combine
    stage 2 bwd   da = q(dy)[row_token] q(W2^T)^T; dh, <da, a>, q(w a) in one SwiGLU-backward pass;
                  dW2 = q(dy)^T q(w a) along R
    stage 1 bwd   dx = sum_k q(dh) q(W1^T)^T (GEMM + combine); dW1 = q(dh)^T q(x) along R

This module moves rows around that math over a transport's :class:`~megamoe.backends.triton.rows.Rows`:
one GPU, or ``all_to_all_single`` for EP over any process group (split sizes read on the host, so not
capturable); the kernels then see the received rows as tokens with one slot each. The expert math
says what travels (:meth:`RowExperts.dispatch_rows`): ``fp8`` quantises ``x`` rowwise at the source
and moves E4M3 bytes and their scales (about half of bf16's bytes); ``mxfp8`` moves bf16 rows and
quantises them on the expert's rank. Both give the bits of quantising at the source, because rowwise
tiles commute with moving rows. The backward moves bf16 ``x`` and ``dy`` rows: the weight gradients
quantise them along R, in other tiles. EP over symmetric memory for ``mxfp8`` is
:class:`~megamoe.backends.triton_mx.ep_symm.MXFP8SymmBackend`. The steps are plain Python around
Triton launches: eager and CUDA graphs, not ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import TransportBackend
from megamoe.backends.triton.combine import combine
from megamoe.backends.triton.configs import block_m
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton.rows import Rows, Transport
from megamoe.quant.cache import WeightCache

ColumnSink = Callable[[Tensor, int], None]
"""``sink(rows [R, width], first_column)``: takes a column range of a GEMM's output rows."""


class RowExperts(Protocol):
    """The quantised expert math on rows already on this rank (``rows`` are ``[T, H]`` read through
    ``a_rows [R]``, or ``[R, H]`` in row order when ``a_rows`` is None)."""

    name: str
    weight_cache: WeightCache

    def row_plan(self, routing: RoutingPlan) -> Any:
        """Its block tables over ``routing``'s rows (device-side, no host sync); has ``.routing``."""

    def check_widths(self, hidden: int, inter: int) -> None: ...

    def dispatch_rows(self, x_TH: Tensor, moved: Rows) -> Any:
        """``x``'s rows moved to their experts by ``moved``, in the form :meth:`gemm1` reads: bf16 rows,
        or rows quantised at the source where the format's tiles move with their rows."""

    def gemm1(
        self,
        rows: Any,
        w1_G2IH: Tensor,
        plan: Any,
        a_rows: Tensor | None,
        row_values: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``h [R, 2I]``, padding rows zero; ``row_values = (values_S, row_slot_R, out_R)``: also
        ``out_R[r] = values_S[row_slot_R[r]]`` (0 on padding rows), in a launch GEMM1 makes anyway."""

    def gemm2(self, h_R2I: Tensor, w2_GHI: Tensor, plan: Any) -> Tensor: ...

    def gemm2_backward(
        self,
        h_R2I: Tensor,
        weights_R: Tensor,
        w2_GHI: Tensor,
        plan: Any,
        dy_rows: Tensor,
        a_rows: Tensor | None,
        need_dw2: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]: ...

    def dgrad1(self, grad_h_R2I: Tensor, w1_G2IH: Tensor, plan: Any, sink: ColumnSink) -> None:
        """``dx rows [R, H] = q(dh) q(W1^T)^T`` handed to ``sink`` in column ranges (padding rows not
        written): each range is dropped once ``sink`` returns, so the expert math sets how many columns
        of rows are alive at a time."""

    def wgrad1(
        self,
        grad_h_R2I: Tensor,
        rows: Tensor,
        w1_G2IH: Tensor,
        plan: Any,
        a_rows: Tensor | None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        """``dW1``; ``scratch`` (``grad_h_R2I`` itself, or None) may hold temporaries once it is read."""


@dataclass(frozen=True, slots=True)
class QuantizedPlan:
    """Device routing of one forward (reused by its backward): the transport's rows and the expert
    math's block tables over them."""

    rows: Any
    moved: Rows


class QuantizedTritonBackend(TransportBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` with ``experts`` over ``transport``."""

    def __init__(self, transport: Transport, experts: RowExperts) -> None:
        self.transport = transport
        self.experts = experts
        self.name = experts.name
        self.weight_cache = experts.weight_cache

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> QuantizedPlan:
        bm = block_m(topk_idx_TK.device)
        moved = self.transport.rows(topk_idx_TK, num_experts=num_experts, group=group, block_m=bm)
        return QuantizedPlan(self.experts.row_plan(moved.routing), moved)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: QuantizedPlan
    ) -> tuple[Tensor | None, ...]:
        self.experts.check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
        r = plan.rows.routing
        rows = self.experts.dispatch_rows(x_TH, plan.moved)
        weights_S = plan.moved.weights_in(topk_weights_TK)
        weights_R = weights_S.new_empty(r.num_rows)  # picked by GEMM1's padding launch
        h = self.experts.gemm1(
            rows, w1_G2IH, plan.rows, r.row_token_R, row_values=(weights_S, r.row_slot_R, weights_R)
        )
        return h, weights_R, None

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: QuantizedPlan,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        """``act_RI`` is ignored: the SwiGLU pass is where ``q(a)`` is made (stage 1 never makes one)."""
        r = plan.rows.routing
        h = h_R2I.contiguous()
        y = h.new_empty(r.num_tokens, w2_GHI.shape[1])  # the combine writes every token
        if not h.shape[0]:
            y.zero_()
        else:
            o = self.experts.gemm2(h, w2_GHI, plan.rows)
            combine(o, r.slot_row_S, y, topk=r.topk, weights_R=dispatch_weights_R.contiguous())
        return plan.moved.tokens_out(y, h_R2I.dtype)

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: QuantizedPlan,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        r = plan.rows.routing
        dh, d_weights, dw2 = self.experts.gemm2_backward(
            h_R2I.contiguous(),
            dispatch_weights_R.contiguous(),
            w2_GHI,
            plan.rows,
            plan.moved.tokens_in(dy_TH.to(h_R2I.dtype)),
            r.row_token_R,
            need_dw2,
            overwrite_h,
        )
        return (
            dh if need_dh else None,
            d_weights.to(dispatch_weights_R.dtype) if need_dweights else None,
            dw2,
        )

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: QuantizedPlan,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        r = plan.rows.routing
        rows = plan.moved.tokens_in(x_TH)
        grad_h = grad_h_R2I.contiguous()
        dx = d_weights = dw1 = None
        grad_weights = grad_dispatch_weights_R.contiguous()
        carried: list[Tensor] = []  # d_weights at the slots, once a combine has carried them there
        if need_dx:
            dx = rows.new_empty(rows.shape)  # the combine writes every token
            if not grad_h.shape[0]:
                dx.zero_()
            else:

                def combine_columns(dx_rows: Tensor, first: int) -> None:
                    columns = dx[:, first : first + dx_rows.shape[1]]
                    to_slots = None
                    if need_dweights and not carried:
                        carried.append(grad_weights.new_empty(r.slot_row_S.shape))
                        to_slots = (grad_weights, carried[0])
                    combine(dx_rows, r.slot_row_S, columns, topk=r.topk, weights_R=None, to_slots=to_slots)

                self.experts.dgrad1(grad_h, w1_G2IH, plan.rows, combine_columns)
            dx = plan.moved.tokens_out(dx, x_TH.dtype)
        if need_dw1:
            scratch = grad_h if grad_h_is_scratch else None  # read last by wgrad1: dgrad1 is done
            dw1 = self.experts.wgrad1(grad_h, rows, w1_G2IH, plan.rows, r.row_token_R, scratch)
        if need_dweights:
            d_slots = carried[0] if carried else r.slot_values_TK(grad_weights).view(-1)
            d_weights = plan.moved.slot_values_out(d_slots)
        return dx, d_weights, dw1
