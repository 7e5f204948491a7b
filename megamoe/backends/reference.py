"""Exact PyTorch backend: the definition of correct for every other backend.

Runs on CPU and GPU in float64/float32/bfloat16, EP over any process group (gloo or NCCL) through
:class:`~megamoe.backends.exchange.TokenExchange`. Each expert's rows are contiguous after the
exchange, so GEMMs are plain per-expert matmuls; sums across the K slots of a token are accumulated in
float32 (float64 for float64 inputs).

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R dispatched rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import StagedBackend, swiglu, swiglu_backward
from megamoe.backends.exchange import TokenExchange


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _per_expert_matmul(rows_RX: Tensor, weights_GYX: Tensor, counts: list[int]) -> Tensor:
    """``out[r] = rows[r] @ weights[expert(r)]^T``: ``[R, X] x [G, Y, X] -> [R, Y]``."""
    out = rows_RX.new_empty((rows_RX.shape[0], weights_GYX.shape[1]))
    for expert, (chunk, out_chunk) in enumerate(zip(rows_RX.split(counts), out.split(counts), strict=True)):
        if chunk.shape[0]:
            torch.matmul(chunk, weights_GYX[expert].t(), out=out_chunk)
    return out


def _per_expert_wgrad(grad_RY: Tensor, rows_RX: Tensor, counts: list[int], like: Tensor) -> Tensor:
    """``dW[g] = sum_{r in g} grad[r]^T rows[r]``: ``[R, Y], [R, X] -> [G, Y, X]`` (zero for empty experts)."""
    dw = torch.zeros_like(like)
    for expert, (g_chunk, x_chunk) in enumerate(
        zip(grad_RY.split(counts), rows_RX.split(counts), strict=True)
    ):
        if g_chunk.shape[0]:
            dw[expert] = (
                g_chunk.to(_acc_dtype(g_chunk.dtype)).t() @ x_chunk.to(_acc_dtype(x_chunk.dtype))
            ).to(like.dtype)
    return dw


class ReferenceBackend(StagedBackend):
    """Per-expert matmuls around an ``all_to_all`` token exchange."""

    name = "reference"

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> TokenExchange:
        return TokenExchange.build(topk_idx_TK, num_experts=num_experts, group=group)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: TokenExchange
    ) -> tuple[Tensor, Tensor, None]:
        x_RH = plan.dispatch_tokens(x_TH)
        h_R2I = _per_expert_matmul(x_RH, w1_G2IH, plan.tokens_per_expert)
        return h_R2I, plan.dispatch_slot_values(topk_weights_TK), None

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: TokenExchange,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        counts = plan.tokens_per_expert
        dx = d_weights = dw1 = None
        if need_dx:
            w1_t = w1_G2IH.transpose(1, 2)  # [G, H, 2I]: dx_row = grad_h_row @ W1
            dx_RH = _per_expert_matmul(grad_h_R2I, w1_t, counts)
            dx = plan.combine_tokens(dx_RH, acc_dtype=_acc_dtype(x_TH.dtype)).to(x_TH.dtype)
        if need_dweights:
            d_weights = plan.combine_slot_values(grad_dispatch_weights_R)
        if need_dw1:
            x_RH = plan.dispatch_tokens(x_TH)  # recomputed: the forward kept only x
            dw1 = _per_expert_wgrad(grad_h_R2I, x_RH, counts, w1_G2IH)
        return dx, d_weights, dw1

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TokenExchange,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        a_RI = swiglu(h_R2I) if act_RI is None else act_RI
        o_RH = _per_expert_matmul(a_RI, w2_GHI, plan.tokens_per_expert)
        weighted = o_RH.to(_acc_dtype(o_RH.dtype)) * dispatch_weights_R.to(_acc_dtype(o_RH.dtype)).unsqueeze(
            1
        )
        return plan.combine_tokens(weighted, acc_dtype=_acc_dtype(h_R2I.dtype)).to(h_R2I.dtype)

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TokenExchange,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        counts = plan.tokens_per_expert
        dy_RH = plan.dispatch_tokens(dy_TH.to(h_R2I.dtype))
        a_RI = swiglu(h_R2I)
        weights_R1 = dispatch_weights_R.to(h_R2I.dtype).unsqueeze(1)
        dh = d_weights = dw2 = None
        if need_dh or need_dweights:
            da_unweighted_RI = _per_expert_matmul(dy_RH, w2_GHI.transpose(1, 2), counts)
            if need_dweights:
                prod = da_unweighted_RI.to(_acc_dtype(a_RI.dtype)) * a_RI.to(_acc_dtype(a_RI.dtype))
                d_weights = prod.sum(1).to(dispatch_weights_R.dtype)
            if need_dh:
                dh = swiglu_backward(h_R2I, da_unweighted_RI * weights_R1)
        if need_dw2:
            dw2 = _per_expert_wgrad(dy_RH, a_RI * weights_R1, counts, w2_GHI)
        return dh, d_weights, dw2
