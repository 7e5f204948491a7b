"""MXFP8 at EP > 1 over the symmetric-memory workspace (the CUDA default transport at EP > 1).

Legend: T tokens, H hidden, I intermediate, K top-k, P pool rows (expert-major; past ``expert_start[G]``
padding).

The one-GPU MX kernels (:class:`~.experts.MXExperts`) read the rows that
:mod:`megamoe.backends.symm.transport` moved: by row index from the broadcast copies (as the one-GPU
path gathers from ``x``), or from a filled pool. Device-side, static shapes: forward and backward
capture in a CUDA graph (the NCCL transport reads split sizes on the host and cannot). The plan is the
bf16 fused path's :class:`~megamoe.backends.symm.ops.SymmState`. The combine is fused: the MX GEMMs
that make expert outputs store each row at its source from their epilogues
(:class:`~.grouped_gemm.RemoteRows`). The dispatch is not yet: the rows arrive before the GEMM starts
(per-tile waits in the MX GEMM, as the bf16 fused kernel has, would overlap them)::

    stage 1 fwd   count exchange, layout; x rows moved; h = q(x)[rows] q(W1)^T
    stage 2 fwd   q(swiglu(h)) q(W2)^T, each row * w stored at its source; y = sum over K (fp32)
    stage 2 bwd   dy rows moved; da = q(dy)[rows] q(W2^T)^T; SwiGLU bwd; dW2 = q(dy[rows])^T q(w a)
    stage 1 bwd   x rows moved again (never saved); q(dh) q(W1^T)^T, each row stored at its source
                  with d(weight); dx = sum over K; dW1 = q(dh)^T q(x[rows])

Stage 2's backward, the same for both formats, is
:class:`~megamoe.backends.symm.quantized.QuantizedSymmBackend`'s.

Rows move in bf16 and are quantised on the expert's rank, which is bit-identical to quantising at the
source (rowwise blocks commute with moving rows).
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm import launch, transport
from megamoe.backends.symm.backend import SymmPlan
from megamoe.backends.symm.ops import SymmState, eager_plan, state_of, symm_backend
from megamoe.backends.symm.quantized import QuantizedSymmBackend
from megamoe.backends.symm.workspace import STATE_DONE
from megamoe.backends.triton_mx.experts import MXExperts, check_widths, row_plan
from megamoe.backends.triton_mx.grouped_gemm import RemoteRows
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.quant.cache import WeightCache
from megamoe.settings import SymmSettings


def _to_sources(
    plan: SymmPlan, *, row_scale_P: Tensor | None = None, scalar_P: Tensor | None = None
) -> RemoteRows:
    """Where the MX GEMM's epilogue sends each pool row: its source's combine slot in the workspace."""
    ws, lay = plan.ws, plan.layout
    return RemoteRows(
        lay.row_src_R,
        lay.row_pos_R,
        ws.view("combine"),
        ws.view("combine_scalar"),
        ws.view("combine_ready"),
        ws.state[:1],
        ws.state[STATE_DONE : STATE_DONE + 1],
        ws.ptrs_dev,
        ws.rank,
        ws.world,
        row_scale_R=None if row_scale_P is None else row_scale_P.float().contiguous(),
        scalar_R=None if scalar_P is None else scalar_P.float().contiguous(),
    )


def stage1_forward(
    experts: MXExperts, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, state: SymmState
) -> tuple[Tensor | None, ...]:
    """``(h [P, 2I], dispatch_weights [P], None, *plan tensors)``."""
    check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
    x, weights_TK = x_TH.contiguous(), topk_weights_TK.contiguous()
    plan = eager_plan(state, x)
    symm_backend(state).exchange(plan, x, weights_TK)
    rows, index, weights = transport.dispatch_rows(plan, x, weights_TK)
    h = experts.gemm1(rows, w1_G2IH, row_plan(plan.recv), index)
    launch.check(plan.ws)
    return (h, weights, None, *state_of(plan))


def stage2_forward(
    experts: MXExperts, h_P2I: Tensor, dispatch_weights_P: Tensor, w2_GHI: Tensor, state: SymmState
) -> Tensor:
    plan = eager_plan(state, h_P2I.new_empty(0, w2_GHI.shape[1]))
    transport.begin(plan)
    remote = _to_sources(plan, row_scale_P=dispatch_weights_P)
    experts.gemm2(h_P2I.contiguous(), w2_GHI, row_plan(plan.recv), remote)
    transport.wait_returned(plan)
    y = transport.combine_rows(plan)
    launch.check(plan.ws)
    return y


def stage1_backward(
    experts: MXExperts,
    x_TH: Tensor,
    w1_G2IH: Tensor,
    state: SymmState,
    grad_h_P2I: Tensor,
    grad_dispatch_weights_P: Tensor,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    need_dx, need_dweights, need_dw1 = needs_grad
    x, grad_h = x_TH.contiguous(), grad_h_P2I.contiguous()
    plan = eager_plan(state, x)
    rows = row_plan(plan.recv)
    transport.begin(plan, x)
    x_rows, index, _ = transport.dispatch_rows(plan, x)  # x again, for dW1 (always: a peer may need it)
    experts.dgrad1(grad_h, w1_G2IH, rows, remote=_to_sources(plan, scalar_P=grad_dispatch_weights_P))
    transport.wait_returned(plan)
    dx = transport.combine_rows(plan) if need_dx else None
    d_weights = transport.returned_scalars(plan, grad_dispatch_weights_P.dtype) if need_dweights else None
    dw1 = experts.wgrad1(grad_h, x_rows, w1_G2IH, rows, index) if need_dw1 else None
    launch.check(plan.ws)
    return dx, d_weights, dw1


class MXFP8SymmBackend(QuantizedSymmBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="mxfp8"`` at EP > 1
    over symmetric memory, with the one-GPU MX kernels of :class:`MXFP8TritonBackend`'s weight cache."""

    name = "triton_mxfp8_symm"

    def __init__(self, settings: SymmSettings, weights: WeightCache | None = None) -> None:
        super().__init__(settings, MXExperts(weights if weights is not None else weight_cache()))

    def stage1_forward(self, x_TH, topk_weights_TK, w1_G2IH, plan):
        return stage1_forward(self.experts, x_TH, topk_weights_TK, w1_G2IH, plan)

    def stage2_forward(self, h_R2I, dispatch_weights_R, w2_GHI, plan, act_RI=None):
        return stage2_forward(self.experts, h_R2I, dispatch_weights_R, w2_GHI, plan)

    def stage1_backward(
        self, x_TH, w1_G2IH, plan, grad_h_R2I, grad_dispatch_weights_R, needs_grad, grad_h_is_scratch=False
    ):
        return stage1_backward(
            self.experts, x_TH, w1_G2IH, plan, grad_h_R2I, grad_dispatch_weights_R, needs_grad
        )
