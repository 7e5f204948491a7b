"""Triton expert backend: fused dispatch + grouped GEMM + SwiGLU + combine, forward and backward.

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R rows this rank computes.

One GPU (no group, or a group of one): the plan is device-side routing tables of static shape
(R = T*K rows, dropped slots padded at the end), so nothing syncs with the host and the op captures
in a CUDA graph. The dispatch is a row gather inside GEMM1, so the forward never materialises the
dispatched ``x`` (backward gathers ``x`` and ``dy`` transiently for the TMA-fed weight gradients);
SwiGLU runs in GEMM1's epilogue (stage 1 hands ``act`` to stage 2 alongside ``h``) and its backward is
one memory pass between the GEMMs; the combine is a deterministic fixed-order gather-reduce.
docs/kernels.md has the measurements behind each choice.

EP > 1, two transports (``MEGAMOE_EP_TRANSPORT``):

* ``symm`` (default on CUDA): :mod:`megamoe.backends.symm`, the token exchange fused into the
  grouped GEMMs over symmetric memory, within one node, no host sync;
* ``nccl`` (default elsewhere, and the serial baseline): NCCL/gloo ``all_to_all_single``
  (:class:`~megamoe.backends.exchange.TokenExchange`, which reads the split sizes on the host) around
  the same Triton expert kernels, which then see the received rows as R "tokens" with one slot each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends import ep_transport
from megamoe.backends.exchange import TokenExchange
from megamoe.backends.symm import ops as symm_ops
from megamoe.backends.symm.ops import SymmState
from megamoe.backends.triton import ops
from megamoe.backends.triton.configs import block_m
from megamoe.backends.triton.routing import RoutingPlan, build_received_plan, build_routing_plan


@dataclass(frozen=True, slots=True)
class TritonPlan:
    """Routing of the rows the kernels compute; ``exchange`` moves them between EP ranks (None: one GPU)."""

    routing: RoutingPlan
    exchange: TokenExchange | None

    def tables(self) -> tuple[int, Tensor, Tensor, Tensor, Tensor, Tensor]:
        r = self.routing
        return (r.block_m, r.row_token_R, r.slot_row_S, r.expert_start_G1, r.tiles_X3, r.num_tiles_1)


def _asked(
    grads: tuple[Tensor, Tensor, Tensor], needs_grad: tuple[bool, bool, bool]
) -> tuple[Tensor | None, ...]:
    """None for the gradients not asked for (the custom ops return them with no elements)."""
    return tuple(g if need else None for g, need in zip(grads, needs_grad, strict=True))


def _ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


class TritonBackend:
    """Implements :class:`~megamoe.backends.base.ExpertBackend` with the kernels of this package.

    With EP > 1 over symmetric memory every step is one of :mod:`megamoe.backends.symm.ops`' custom ops
    (the plan is a :class:`SymmState`); stage 1 returns the plan's tensors after ``act``, and
    :meth:`with_stage1_state` hands them to the later steps.
    """

    name = "triton"

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> TritonPlan | SymmState:
        ep = _ep_size(group)
        bm = block_m(topk_idx_TK.device)
        if ep > 1 and ep_transport(topk_idx_TK.device) == "symm":
            return SymmState(group.group_name, num_experts, topk_idx_TK)
        if ep == 1:
            return TritonPlan(build_routing_plan(topk_idx_TK, num_experts=num_experts, block_m=bm), None)
        exchange = TokenExchange.build(topk_idx_TK, num_experts=num_experts, group=group)
        routing = build_received_plan(exchange.tokens_per_expert, block_m=bm, device=topk_idx_TK.device)
        return TritonPlan(routing, exchange)

    def with_stage1_state(
        self, plan: TritonPlan | SymmState, state: tuple[Tensor, ...]
    ) -> TritonPlan | SymmState:
        """The plan with what stage 1 returned after ``act`` (the symmetric-memory path's layout)."""
        return plan.with_state(state) if isinstance(plan, SymmState) else plan

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: TritonPlan | SymmState
    ) -> tuple[Tensor, ...]:
        if isinstance(plan, SymmState):  # the fused EP kernels run SwiGLU as a pass in stage 2: no act
            h, weights, *state = symm_ops.stage1_forward(
                x_TH, plan.topk_idx_TK, topk_weights_TK, w1_G2IH, plan.group_name, plan.num_experts
            )
            return (h, weights, None, *state)
        r = plan.routing
        if plan.exchange is None:
            rows = x_TH.contiguous()
            weights_R = r.row_values_R(topk_weights_TK)
        else:
            rows = plan.exchange.dispatch_tokens(x_TH.contiguous())
            weights_R = plan.exchange.dispatch_slot_values(topk_weights_TK)
        h, act = ops.gemm1_forward(rows, w1_G2IH.contiguous(), r.topk, *plan.tables())
        return h, weights_R, act

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: TritonPlan | SymmState,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if isinstance(plan, SymmState):
            grads = symm_ops.stage1_backward(
                x_TH, w1_G2IH, grad_h_R2I, grad_dispatch_weights_R, list(plan.state), plan.group_name,
                plan.num_experts, plan.topk_idx_TK.shape[1], *needs_grad,
            )  # fmt: skip
            return _asked(grads, needs_grad)
        need_dx, need_dweights, need_dw1 = needs_grad
        r = plan.routing
        ex = plan.exchange
        rows = x_TH.contiguous() if ex is None else ex.dispatch_tokens(x_TH.contiguous())
        dx = dw1 = d_weights = None
        if need_dx or need_dw1:
            dx_rows, dw1 = ops.gemm1_backward(
                rows, w1_G2IH.contiguous(), grad_h_R2I.contiguous(), need_dx, need_dw1, r.topk, *plan.tables()
            )
            if need_dx:
                dx = (
                    dx_rows
                    if ex is None
                    else ex.combine_tokens(dx_rows, acc_dtype=torch.float32).to(x_TH.dtype)
                )
            dw1 = dw1 if need_dw1 else None
        if need_dweights:
            if ex is None:
                d_weights = r.slot_values_TK(grad_dispatch_weights_R)
            else:
                d_weights = ex.combine_slot_values(grad_dispatch_weights_R)
        return dx, d_weights, dw1

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TritonPlan | SymmState,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        if isinstance(plan, SymmState):
            T, K = plan.topk_idx_TK.shape
            return symm_ops.stage2_forward(
                h_R2I, dispatch_weights_R, w2_GHI, list(plan.state), plan.group_name, plan.num_experts, T, K
            )
        r = plan.routing
        h = h_R2I.contiguous()
        y = ops.gemm2_combine_forward(
            h,
            h.new_empty(0) if act_RI is None else act_RI.contiguous(),
            dispatch_weights_R.contiguous(),
            w2_GHI.contiguous(),
            r.num_tokens,
            r.topk,
            *plan.tables(),
        )
        if plan.exchange is None:
            return y
        return plan.exchange.combine_tokens(y, acc_dtype=torch.float32).to(h_R2I.dtype)

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TritonPlan | SymmState,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if isinstance(plan, SymmState):
            grads = symm_ops.stage2_backward(
                h_R2I, dispatch_weights_R, w2_GHI, dy_TH, list(plan.state), plan.group_name, plan.num_experts,
                plan.topk_idx_TK.shape[1], *needs_grad,
            )  # fmt: skip
            return _asked(grads, needs_grad)
        need_dh, need_dweights, need_dw2 = needs_grad
        r = plan.routing
        dy = dy_TH.to(h_R2I.dtype).contiguous()
        if plan.exchange is not None:
            dy = plan.exchange.dispatch_tokens(dy)
        dh, d_weights, dw2 = ops.gemm2_backward(
            h_R2I.contiguous(),
            dispatch_weights_R.contiguous(),
            w2_GHI.contiguous(),
            dy,
            need_dw2,
            r.topk,
            *plan.tables(),
        )
        return (dh if need_dh else None, d_weights if need_dweights else None, dw2 if need_dw2 else None)
