"""Blockwise FP8 at EP > 1 over the symmetric-memory workspace (``turbo_mega_moe_ep_transport: symm``).

Legend: T tokens, H hidden, I intermediate, K top-k, P pool rows (expert-major; past ``expert_start[G]``
padding).

The one-GPU FP8 kernels (:class:`~.experts.FP8Experts`) read the rows that
:mod:`megamoe.backends.symm.transport` moved: by row index from the broadcast copies (as the one-GPU
path gathers from ``x``), or from a filled pool. Device-side, static shapes: forward and backward
capture in a CUDA graph (the NCCL transport reads split sizes on the host and cannot). The plan is the
bf16 fused path's :class:`~megamoe.backends.symm.ops.SymmState`. The FP8 GEMMs have no remote epilogue,
so the rows they make go home in one more launch (:func:`~megamoe.backends.symm.transport.return_rows`)::

    stage 1 fwd   count exchange, layout; x rows moved; t(x) rowwise here; h = t(x)[rows] b(W1)^T
    stage 2 fwd   o = t(swiglu(h)) b(W2)^T; each row * w sent to its source; y = sum over K (fp32)
    stage 2 bwd   dy rows moved; da = t(dy)[rows] b(W2^T)^T; SwiGLU bwd; dW2 = t(dy[rows])^T t(w a)
    stage 1 bwd   x rows moved again (never saved); t(dh) b(W1^T)^T in column ranges, each sent to the
                  sources (d(weight) with the first); dx = sum over K; dW1 = t(dh)^T t(x[rows])

Stage 2's backward, the same for both formats, is
:class:`~megamoe.backends.symm.quantized.QuantizedSymmBackend`'s.

Rows move in bf16 and are quantised on the expert's rank, which gives the bits of quantising at the
source (rowwise tiles commute with moving rows); the NCCL transport moves them as E4M3 bytes and
scales instead.
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm import launch, transport
from megamoe.backends.symm.ops import SymmState, eager_plan, state_of, symm_backend
from megamoe.backends.symm.quantized import QuantizedSymmBackend
from megamoe.backends.triton_fp8.experts import FP8Experts
from megamoe.backends.triton_fp8.weights import weight_cache
from megamoe.quant.cache import WeightCache
from megamoe.settings import SymmSettings


class FP8SymmBackend(QuantizedSymmBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="fp8"`` at EP > 1 over
    symmetric memory, with the one-GPU FP8 kernels and their weight cache."""

    name = "triton_fp8_symm"
    experts: FP8Experts

    def __init__(self, settings: SymmSettings, weights: WeightCache | None = None) -> None:
        super().__init__(settings, FP8Experts(weights if weights is not None else weight_cache()))

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, state: SymmState
    ) -> tuple[Tensor | None, ...]:
        """``(h [P, 2I], dispatch_weights [P], None, *plan tensors)``."""
        experts = self.experts
        experts.check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
        x, weights_TK = x_TH.contiguous(), topk_weights_TK.contiguous()
        plan = eager_plan(state, x)
        symm_backend(state).exchange(plan, x, weights_TK)
        rows, index, weights = transport.dispatch_rows(plan, x, weights_TK)
        pool = experts.row_plan(plan.recv)
        h = experts.gemm1(experts.rowwise(rows, pool, index), w1_G2IH, pool, index)
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
        """``act_RI`` is ignored: the SwiGLU pass is where ``t(a)`` is made."""
        plan = eager_plan(state, h_P2I.new_empty(0, w2_GHI.shape[1]))
        transport.begin(plan)
        o = self.experts.gemm2(h_P2I.contiguous(), w2_GHI, self.experts.row_plan(plan.recv))
        transport.return_rows(plan, o, row_scale_P=dispatch_weights_P)
        transport.wait_returned(plan)
        y = transport.combine_rows(plan)
        launch.check(plan.ws)
        return y

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
        experts = self.experts
        x, grad_h = x_TH.contiguous(), grad_h_P2I.contiguous()
        plan = eager_plan(state, x)
        pool = experts.row_plan(plan.recv)
        transport.begin(plan, x)
        x_rows, index, _ = transport.dispatch_rows(plan, x)  # x again, for dW1 (always: a peer may need it)
        hidden, sent = x.shape[1], []

        def home(dx_rows: Tensor, first: int) -> None:
            transport.return_rows(
                plan,
                dx_rows,
                first_column=first,
                scalar_P=None if sent else grad_dispatch_weights_P,
                last=first + dx_rows.shape[1] == hidden,
            )
            sent.append(first)

        experts.dgrad1(grad_h, w1_G2IH, pool, home)
        if not sent:  # no rows here (or no columns): the peers still wait for this rank's flag
            home(grad_h.new_empty(grad_h.shape[0], hidden), 0)
        transport.wait_returned(plan)
        dx = transport.combine_rows(plan) if need_dx else None
        d_weights = transport.returned_scalars(plan, grad_dispatch_weights_P.dtype) if need_dweights else None
        scratch = grad_h if grad_h_is_scratch else None  # read last by wgrad1: dgrad1 is done
        dw1 = experts.wgrad1(grad_h, x_rows, w1_G2IH, pool, index, scratch) if need_dw1 else None
        launch.check(plan.ws)
        return dx, d_weights, dw1
