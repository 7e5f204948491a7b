"""Triton expert backend: fused dispatch + grouped GEMM + SwiGLU + combine, forward and backward.

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R rows this rank computes.

The expert math of this module runs over a transport's :class:`~.rows.Rows`
(:class:`~.rows.LocalTransport` on one GPU, :class:`~.rows.AllToAllTransport` for EP over any process
group). On one GPU the plan is device-side routing tables of static shape (R = T*K rows, dropped slots
padded at the end), so nothing syncs with the host and the op captures in a CUDA graph. The dispatch
is a row gather inside GEMM1, so the forward never materialises the dispatched ``x`` (backward gathers
``x`` and ``dy`` transiently for the TMA-fed weight gradients); SwiGLU runs in GEMM1's epilogue
(stage 1 hands ``act`` to stage 2 alongside ``h``) and its backward is one memory pass between the
GEMMs; the combine is a deterministic fixed-order gather-reduce. docs/kernels.md has the measurements
behind each choice.

The exchange fused into these GEMMs over symmetric memory is its own backend
(:class:`megamoe.backends.symm.experts.SymmTritonBackend`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import TransportBackend
from megamoe.backends.triton import ops
from megamoe.backends.triton.configs import block_m
from megamoe.backends.triton.rows import Rows, Transport


class TritonBackend(TransportBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` with the kernels of this package, over
    ``transport``."""

    name = "triton"

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def make_plan(self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None) -> Rows:
        bm = block_m(topk_idx_TK.device)
        return self.transport.rows(topk_idx_TK, num_experts=num_experts, group=group, block_m=bm)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: Rows
    ) -> tuple[Tensor, ...]:
        r = plan.routing
        h, act, weights_R = ops.gemm1_forward(
            plan.tokens_in(x_TH),
            w1_G2IH.contiguous(),
            plan.weights_in(topk_weights_TK),
            r.row_slot_R,
            r.topk,
            *r.kernel_tables(),
        )
        return h, weights_R, act

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: Rows,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        r = plan.routing
        dx = dw1 = d_weights = None
        grad_weights = grad_dispatch_weights_R.contiguous()
        if need_dx or need_dw1:
            dx_rows, dw1, d_slots = ops.gemm1_backward(
                plan.tokens_in(x_TH), w1_G2IH.contiguous(), grad_h_R2I.contiguous(), grad_weights,
                need_dx, need_dw1, need_dweights and need_dx, r.topk, *r.kernel_tables(),
            )  # fmt: skip
            dx = plan.tokens_out(dx_rows, x_TH.dtype) if need_dx else None
            dw1 = dw1 if need_dw1 else None
        if need_dweights:
            if not need_dx:  # no combine to carry it
                d_slots = r.slot_values_TK(grad_weights).view(-1)
            d_weights = plan.slot_values_out(d_slots)
        return dx, d_weights, dw1

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: Rows,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        r = plan.routing
        h = h_R2I.contiguous()
        y = ops.gemm2_combine_forward(
            h,
            h.new_empty(0) if act_RI is None else act_RI.contiguous(),
            dispatch_weights_R.contiguous(),
            w2_GHI.contiguous(),
            r.num_tokens,
            r.topk,
            *plan.routing.kernel_tables(),
        )
        return plan.tokens_out(y, h_R2I.dtype)

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: Rows,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        dh, d_weights, dw2 = ops.gemm2_backward(
            h_R2I.contiguous(),
            dispatch_weights_R.contiguous(),
            w2_GHI.contiguous(),
            plan.tokens_in(dy_TH.to(h_R2I.dtype)),
            need_dw2,
            overwrite_h,
            plan.routing.topk,
            *plan.routing.kernel_tables(),
        )
        return (dh if need_dh else None, d_weights if need_dweights else None, dw2 if need_dw2 else None)
