"""The quantised expert math (MXFP8, FP8) over the symmetric-memory workspace: what both formats share.

The four steps are the same for both formats but for how the rows that GEMM2 and fc1's dgrad make
go home, from the MX GEMMs' remote epilogue or by :func:`~megamoe.backends.symm.transport.return_rows`
after the FP8 GEMMs, and for the rows GEMM1 takes (MX moves bf16 rows and quantises them in its GEMM1;
FP8 moves rows quantised at the source, their scales beside them): each format's module
(:mod:`megamoe.backends.triton_mx.ep_symm`, :mod:`megamoe.backends.triton_fp8.ep_symm`) subclasses
:class:`QuantizedSymmBackend` with those.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from megamoe.backends.symm import launch, transport
from megamoe.backends.symm.backend import SymmPlan
from megamoe.backends.symm.ops import SymmState, SymmStatePlans, eager_plan, state_of, symm_backend
from megamoe.settings import SymmSettings


class QuantizedSymmBackend(SymmStatePlans):
    """An :class:`~megamoe.backends.base.ExpertBackend` of ``experts`` (a format's one-GPU expert math,
    with its weight cache) over symmetric memory."""

    def __init__(self, settings: SymmSettings, experts: Any) -> None:
        super().__init__(settings)
        self.experts = experts
        self.weight_cache = experts.weight_cache

    def rows_to_send(self, x_TH: Tensor) -> Tensor:
        """What travels for GEMM1: ``x``'s rows, or a form of them no wider (in ``x``'s dtype)."""
        return x_TH

    def gemm1_rows(self, rows: Tensor, pool: Any, index: Tensor | None, hidden: int) -> Any:
        """The moved rows of :meth:`rows_to_send` as the format's GEMM1 takes them."""
        return rows

    def gemm2_home(self, plan: SymmPlan, h_P2I: Tensor, weights_P: Tensor, w2_GHI: Tensor, pool: Any) -> None:
        """GEMM2's rows, each times its routing weight, into their sources' combine slots; releases
        ``combine_ready`` (also on a rank without rows)."""
        raise NotImplementedError

    def dgrad1_home(
        self, plan: SymmPlan, grad_h_P2I: Tensor, w1_G2IH: Tensor, pool: Any, grad_weights_P: Tensor
    ) -> None:
        """fc1's dgrad rows into their sources' combine slots, each row's ``grad_weights`` beside it;
        releases ``combine_ready`` (also on a rank without rows)."""
        raise NotImplementedError

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, state: SymmState
    ) -> tuple[Tensor | None, ...]:
        """``(h [P, 2I], dispatch_weights [P], None, *plan tensors)``."""
        self.experts.check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
        x, weights_TK = x_TH.contiguous(), topk_weights_TK.contiguous()
        plan = eager_plan(state, x)
        sent = self.rows_to_send(x)
        symm_backend(state).exchange(plan, x, weights_TK, sent)
        rows, index, weights = transport.dispatch_rows(plan, sent, weights_TK)
        pool = self.experts.row_plan(plan.recv)
        h = self.experts.gemm1(self.gemm1_rows(rows, pool, index, x.shape[1]), w1_G2IH, pool, index)
        launch.check(plan.ws)
        return (h, weights, None, *state_of(plan))

    def stage2_forward(
        self,
        h_P2I: Tensor,
        dispatch_weights_P: Tensor,
        w2_GHI: Tensor,
        state: SymmState,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        """``act_RI`` is ignored: the format's SwiGLU pass is where its GEMM2 operand is made."""
        plan = eager_plan(state, h_P2I.new_empty(0, w2_GHI.shape[1]))
        transport.begin(plan)
        pool = self.experts.row_plan(plan.recv)
        self.gemm2_home(plan, h_P2I.contiguous(), dispatch_weights_P, w2_GHI, pool)
        transport.wait_returned(plan)
        y = transport.combine_rows(plan)
        launch.check(plan.ws)
        return y

    def stage2_backward(
        self,
        h_P2I: Tensor,
        dispatch_weights_P: Tensor,
        w2_GHI: Tensor,
        state: SymmState,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        dy = dy_TH.to(h_P2I.dtype).contiguous()
        plan = eager_plan(state, dy)
        transport.begin(plan, dy)
        rows, index, _ = transport.dispatch_rows(plan, dy)  # always: a peer may need this rank's dy
        dh, d_weights, dw2 = self.experts.gemm2_backward(
            h_P2I.contiguous(),
            dispatch_weights_P.contiguous(),
            w2_GHI,
            self.experts.row_plan(plan.recv),
            rows,
            index,
            need_dw2,
            overwrite_h,
        )
        launch.check(plan.ws)
        return (
            dh if need_dh else None,
            d_weights.to(dispatch_weights_P.dtype) if need_dweights else None,
            dw2,
        )

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        state: SymmState,
        grad_h_P2I: Tensor,
        grad_dispatch_weights_P: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        x, grad_h = x_TH.contiguous(), grad_h_P2I.contiguous()
        plan = eager_plan(state, x)
        pool = self.experts.row_plan(plan.recv)
        transport.begin(plan, x)
        x_rows, index, _ = transport.dispatch_rows(plan, x)  # x again, for dW1 (always: a peer may need it)
        self.dgrad1_home(plan, grad_h, w1_G2IH, pool, grad_dispatch_weights_P)
        transport.wait_returned(plan)
        dx = transport.combine_rows(plan) if need_dx else None
        d_weights = transport.returned_scalars(plan, grad_dispatch_weights_P.dtype) if need_dweights else None
        scratch = grad_h if grad_h_is_scratch else None  # read last by wgrad1: dgrad1 is done
        dw1 = self.experts.wgrad1(grad_h, x_rows, w1_G2IH, pool, index, scratch) if need_dw1 else None
        launch.check(plan.ws)
        return dx, d_weights, dw1
