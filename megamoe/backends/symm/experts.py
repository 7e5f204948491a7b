"""The bf16 Triton experts with the token exchange fused into their GEMMs (EP >= 2, one node).

Every step is one of :mod:`.ops`' custom ops (one opaque node each for torch.compile); the plan is a
:class:`~.ops.SymmState`, and stage 1 returns the plan's tensors after ``act`` for
:meth:`SymmTritonBackend.with_stage1_state` to hand to the later steps. The kernels run SwiGLU as a
pass in stage 2, so stage 1 makes no ``act``.
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm import ops
from megamoe.backends.symm.ops import SymmState, SymmStatePlans


def _asked(
    grads: tuple[Tensor, Tensor, Tensor], needs_grad: tuple[bool, bool, bool]
) -> tuple[Tensor | None, ...]:
    """None for the gradients not asked for (the custom ops return them with no elements)."""
    return tuple(g if need else None for g, need in zip(grads, needs_grad, strict=True))


class SymmTritonBackend(SymmStatePlans):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` over symmetric memory; the settings
    configure the group's workspace when the first op allocates it."""

    name = "triton_symm"

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: SymmState
    ) -> tuple[Tensor | None, ...]:
        h, weights, *state = ops.stage1_forward(
            x_TH, plan.topk_idx_TK, topk_weights_TK, w1_G2IH, plan.group_name, plan.num_experts, plan.settings
        )
        return (h, weights, None, *state)

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: SymmState,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        grads = ops.stage1_backward(
            x_TH, w1_G2IH, grad_h_R2I, grad_dispatch_weights_R, list(plan.state), plan.group_name,
            plan.num_experts, plan.topk_idx_TK.shape[1], *needs_grad,
        )  # fmt: skip
        return _asked(grads, needs_grad)

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: SymmState,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        T, K = plan.topk_idx_TK.shape
        return ops.stage2_forward(
            h_R2I, dispatch_weights_R, w2_GHI, list(plan.state), plan.group_name, plan.num_experts, T, K
        )

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: SymmState,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        grads = ops.stage2_backward(
            h_R2I, dispatch_weights_R, w2_GHI, dy_TH, list(plan.state), plan.group_name, plan.num_experts,
            plan.topk_idx_TK.shape[1], *needs_grad,
        )  # fmt: skip
        return _asked(grads, needs_grad)
