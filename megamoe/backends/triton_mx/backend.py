"""MXFP8 Triton expert backend: the emulation's table (:mod:`megamoe.backends.quantized_reference`) on
E4M3 tensor cores with per-32 scaled partial sums, quantisation fused into the producers.

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R = T*K expert-sorted rows
(dropped slots padded at the end), NB = ceil(R / 32) + G block slots along R.

    stage 1 fwd   q(x) rowwise at the source [T, H]          quantize_rows (T rows, not R)
                  h = q(x)[row_token] q(W1)^T                 MX GEMM, the dispatch a row gather
    stage 2 fwd   q(a) = q(silu(gate) up) rowwise             SwiGLU pass emitting E4M3 + codes
                  o = q(a) q(W2)^T;  y = sum_k w o (fp32)     MX GEMM; the bf16 path's combine
    stage 2 bwd   q(dy) rowwise at the source; da = q(dy)[row_token] q(W2^T)^T (fp32)
                  dh, <da, a>, q(w a) along R                 one SwiGLU-backward pass
                  dW2 = q(dy)^T q(w a), along R               segment quantiser (dy gathered) + MX wgrad
    stage 1 bwd   q(dh) rowwise; dx = sum_k q(dh) q(W1^T)^T   MX GEMM + combine
                  dW1 = q(dh)^T q(x), along R                 segment quantiser (x gathered) + MX wgrad

The kernels themselves are :class:`~.experts.MXExperts`; this module moves rows around them. Weights
come from one :class:`~megamoe.quant.cache.WeightCache` (both forms, refreshed per optimizer step)
filled by the Triton quantisers. The steps are plain Python around Triton launches (no
``torch.library`` custom ops yet): eager and CUDA graphs, not ``torch.compile(fullgraph=True)``.

This backend runs over a transport's :class:`~megamoe.backends.triton.rows.Rows`: one GPU, or
``all_to_all_single`` for EP over any process group (split sizes read on the host, so not
capturable), around the same kernels, which then see the received rows as tokens with one slot each.
EP over symmetric memory is :class:`.ep_symm.MXFP8SymmBackend` (device-side copies, no host sync).

Both EP paths move bf16 rows and quantise them on the expert's rank, which is bit-identical to quantising at
the source because rowwise blocks commute with moving rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import StagedBackend
from megamoe.backends.triton.combine import combine
from megamoe.backends.triton.configs import block_m
from megamoe.backends.triton.rows import Rows, Transport
from megamoe.backends.triton_mx.experts import MXExperts, RowPlan, check_widths, row_plan
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.quant.cache import WeightCache


@dataclass(frozen=True, slots=True)
class MXPlan:
    """Device routing of one forward (reused by its backward): the transport's rows and the MX
    kernels' block tables over them."""

    rows: RowPlan
    moved: Rows


class MXFP8TritonBackend(StagedBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="mxfp8"`` over
    ``transport``."""

    name = "triton_mxfp8"

    def __init__(self, transport: Transport, weights: WeightCache | None = None) -> None:
        self.transport = transport
        self.weight_cache = weights if weights is not None else weight_cache()
        self.experts = MXExperts(self.weight_cache)

    def make_plan(self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None) -> MXPlan:
        bm = block_m(topk_idx_TK.device)
        moved = self.transport.rows(topk_idx_TK, num_experts=num_experts, group=group, block_m=bm)
        return MXPlan(row_plan(moved.routing), moved)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: MXPlan
    ) -> tuple[Tensor | None, ...]:
        check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
        r = plan.rows.routing
        rows, weights_R = plan.moved.tokens_in(x_TH), plan.moved.weights_in(topk_weights_TK)
        return self.experts.gemm1(rows, w1_G2IH, plan.rows, r.row_token_R), weights_R, None

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: MXPlan,
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
        plan: MXPlan,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
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
        plan: MXPlan,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        r = plan.rows.routing
        rows = plan.moved.tokens_in(x_TH)
        grad_h = grad_h_R2I.contiguous()
        dx = d_weights = dw1 = None
        if need_dx:
            dx = rows.new_empty(rows.shape)  # the combine writes every token
            if not grad_h.shape[0]:
                dx.zero_()
            else:
                dx_rows = self.experts.dgrad1(grad_h, w1_G2IH, plan.rows)
                combine(dx_rows, r.slot_row_S, dx, topk=r.topk, weights_R=None)
            dx = plan.moved.tokens_out(dx, x_TH.dtype)
        if need_dw1:
            dw1 = self.experts.wgrad1(grad_h, rows, w1_G2IH, plan.rows, r.row_token_R)
        if need_dweights:
            d_weights = plan.moved.slot_values_out(grad_dispatch_weights_R)
        return dx, d_weights, dw1
