"""MXFP8 Triton expert backend: the emulation's table (:mod:`megamoe.backends.mxfp8_reference`) on
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

Weights come from one :class:`~megamoe.quant.cache.WeightCache` (both forms, refreshed per
optimizer step) filled by the Triton quantisers. Everything has static shapes and reads routing only
on the device: no host sync, so forward and backward capture in a CUDA graph. The steps are plain
Python around Triton launches (no ``torch.library`` custom ops yet): eager and CUDA graphs, not
``torch.compile(fullgraph=True)``.

EP > 1 moves bf16 rows with :class:`~megamoe.backends.exchange.TokenExchange` (NCCL/gloo
``all_to_all_single``, split sizes read on the host, so not capturable) around the same kernels,
which then see the received rows as tokens with one slot each; the rows are quantised after the
exchange, which is bit-identical because rowwise blocks commute with moving rows. The fused
symmetric-memory EP path (:mod:`megamoe.backends.symm`) has no MXFP8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.exchange import TokenExchange
from megamoe.backends.triton.combine import combine
from megamoe.backends.triton.configs import block_m, num_programs
from megamoe.backends.triton.padding import zero_padding_rows
from megamoe.backends.triton.routing import RoutingPlan, build_routing_plan
from megamoe.backends.triton_mx.configs import gemm_config, wgrad_block_align, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import mx_grouped_gemm
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_segments, segment_block_starts
from megamoe.backends.triton_mx.swiglu import swiglu_backward_quant, swiglu_quant
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.backends.triton_mx.wgrad import mx_wgrad
from megamoe.errors import UnsupportedSettingError
from megamoe.quant.cache import WeightCache
from megamoe.quant.mx import BLOCK, MXTensor


@dataclass(frozen=True, slots=True)
class MXPlan:
    """Device routing of one forward (reused by its backward) and the wgrad's block slots along R."""

    routing: RoutingPlan
    exchange: TokenExchange | None
    block_start_G1: Tensor
    """first block slot of each expert's rows (``ceil(rows / 32)`` slots each), on the device."""
    num_blocks: int
    """static bound on the block slots: ``ceil(R / 32) + G * block_align``."""
    block_align: int
    """each expert's first block slot is a multiple of this (:data:`~.configs.WGRAD_BLOCK_ALIGN` on CUDA)."""

    @property
    def valid_rows_1(self) -> Tensor:
        return self.routing.expert_start_G1[-1:]


def _ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _check_widths(hidden: int, inter: int) -> None:
    for name, value in (("hidden size H", hidden), ("intermediate size I", inter)):
        if value % 16:
            raise UnsupportedSettingError(
                name,
                value,
                "the MXFP8 Triton kernels read E4M3 rows by TMA, which needs 16-byte row strides",
                "Use a multiple of 16, or backend='reference' with precision='mxfp8'",
            )


class MXFP8TritonBackend:
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="mxfp8"`` on one GPU."""

    name = "triton_mxfp8"

    def __init__(self, weights: WeightCache | None = None) -> None:
        self.weight_cache = weights if weights is not None else weight_cache()

    def _w(self, w_GYX: Tensor, *, transposed: bool) -> MXTensor:
        return self.weight_cache.get(w_GYX, transposed=transposed)

    def make_plan(self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None) -> MXPlan:
        device = topk_idx_TK.device
        if _ep_size(group) == 1:
            routing = build_routing_plan(topk_idx_TK, num_experts=num_experts, block_m=block_m(device))
            exchange = None
        else:
            exchange = TokenExchange.build(topk_idx_TK, num_experts=num_experts, group=group)
            counts = torch.tensor(exchange.tokens_per_expert, device=device)
            local_expert_R1 = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
            routing = build_routing_plan(
                local_expert_R1.unsqueeze(1), num_experts=exchange.num_local_experts, block_m=block_m(device)
            )
        align = wgrad_block_align(device)
        num_blocks = -(-routing.num_rows // BLOCK) + routing.num_experts * align
        block_start = segment_block_starts(routing.expert_start_G1, align=align)
        return MXPlan(routing, exchange, block_start, num_blocks, align)

    def _gemm(self, a: MXTensor, b: MXTensor, out: Tensor, plan: MXPlan, a_rows: Tensor | None) -> None:
        mx_grouped_gemm(
            a,
            b,
            out,
            plan.routing,
            config=gemm_config(out.device),
            num_sms=num_programs(out.device),
            a_rows=a_rows,
        )

    def _wgrad(self, p: MXTensor, q: MXTensor, out: Tensor, plan: MXPlan) -> Tensor:
        mx_wgrad(
            p,
            q,
            out,
            plan.block_start_G1,
            config=wgrad_config(out.device),
            num_sms=num_programs(out.device),
            block_align=plan.block_align,
        )
        return out

    def _along_r(self, src: Tensor, plan: MXPlan, index_R: Tensor | None) -> MXTensor:
        r = plan.routing
        return quantize_segments(
            src, r.expert_start_G1, plan.block_start_G1, plan.num_blocks, index_R=index_R
        )

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: MXPlan
    ) -> tuple[Tensor, Tensor, None]:
        _check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
        r = plan.routing
        if plan.exchange is None:
            rows = x_TH.contiguous()
            weights_R = r.row_values_R(topk_weights_TK)
        else:
            rows = plan.exchange.dispatch_tokens(x_TH.contiguous())
            weights_R = plan.exchange.dispatch_slot_values(topk_weights_TK)
        h = rows.new_empty(r.num_rows, w1_G2IH.shape[1])
        if h.numel():
            self._gemm(quantize_rows(rows), self._w(w1_G2IH, transposed=False), h, plan, r.row_token_R)
            zero_padding_rows(h, r.expert_start_G1)
        return h, weights_R, None

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: MXPlan,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        """``act_RI`` is ignored: the SwiGLU pass is where ``q(a)`` is made (stage 1 never makes one)."""
        r = plan.routing
        h = h_R2I.contiguous()
        y = h.new_empty(r.num_tokens, w2_GHI.shape[1])  # the combine writes every token
        if not h.shape[0]:
            y.zero_()
        else:
            o = h.new_empty(h.shape[0], w2_GHI.shape[1])
            self._gemm(swiglu_quant(h, plan.valid_rows_1), self._w(w2_GHI, transposed=False), o, plan, None)
            combine(o, r.slot_row_S, y, topk=r.topk, weights_R=dispatch_weights_R.contiguous())
        if plan.exchange is None:
            return y
        return plan.exchange.combine_tokens(y, acc_dtype=torch.float32).to(h_R2I.dtype)

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
        r = plan.routing
        h = h_R2I.contiguous()
        R, inter = h.shape[0], h.shape[1] // 2
        dy = dy_TH.to(h.dtype).contiguous()
        if plan.exchange is not None:
            dy = plan.exchange.dispatch_tokens(dy)
        dh = h.new_empty(R, 2 * inter)  # routed rows: the SwiGLU pass; padding rows: zeroed below
        d_weights = torch.zeros(R, dtype=torch.float32, device=h.device)
        dw2 = torch.zeros_like(w2_GHI) if need_dw2 else None
        if R:
            da = torch.empty(R, inter, dtype=torch.float32, device=h.device)
            self._gemm(quantize_rows(dy), self._w(w2_GHI, transposed=True), da, plan, r.row_token_R)
            aw = swiglu_backward_quant(
                h,
                da,
                dispatch_weights_R.contiguous(),
                dh,
                d_weights,
                r.expert_start_G1,
                plan.block_start_G1,
                plan.num_blocks,
            )
            zero_padding_rows(dh, r.expert_start_G1)
            if need_dw2:
                self._wgrad(self._along_r(dy, plan, r.row_token_R), aw, dw2, plan)
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
        r = plan.routing
        ex = plan.exchange
        rows = x_TH.contiguous() if ex is None else ex.dispatch_tokens(x_TH.contiguous())
        grad_h = grad_h_R2I.contiguous()
        R, H = grad_h.shape[0], rows.shape[1]
        dx = d_weights = dw1 = None
        if need_dx:
            dx = rows.new_empty(rows.shape[0], H)  # the combine writes every token
            if not R:
                dx.zero_()
            else:
                dx_rows = rows.new_empty(R, H)
                g_rows = quantize_rows(grad_h, valid_rows_1=plan.valid_rows_1)
                self._gemm(g_rows, self._w(w1_G2IH, transposed=True), dx_rows, plan, None)
                combine(dx_rows, r.slot_row_S, dx, topk=r.topk, weights_R=None)
            if ex is not None:
                dx = ex.combine_tokens(dx, acc_dtype=torch.float32).to(x_TH.dtype)
        if need_dw1:
            dw1 = torch.zeros_like(w1_G2IH)
            if R:
                p = self._along_r(grad_h, plan, None)
                self._wgrad(p, self._along_r(rows, plan, r.row_token_R), dw1, plan)
        if need_dweights:
            if ex is None:
                d_weights = r.slot_values_TK(grad_dispatch_weights_R)
            else:
                d_weights = ex.combine_slot_values(grad_dispatch_weights_R)
        return dx, d_weights, dw1
