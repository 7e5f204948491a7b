"""MXFP8 at EP > 1 over the symmetric-memory workspace (``MEGAMOE_EP_TRANSPORT=symm``, the CUDA default).

Legend: T tokens, H hidden, I intermediate, K top-k, P pool rows (expert-major; past ``expert_start[G]``
padding).

The one-GPU MX kernels (:class:`~.experts.MXExperts`) run on the workspace's pool in pool order, and
:mod:`megamoe.backends.symm.transport` moves the rows: device-side, static shapes, so forward and
backward capture in a CUDA graph (the NCCL transport reads split sizes on the host and cannot). The
plan is the bf16 fused path's :class:`~megamoe.backends.symm.ops.SymmState`. The exchange does not
yet overlap with the MX GEMMs: that needs per-tile waits and two-source row addressing in the MX GEMM,
as the bf16 fused kernel has (docs/mxfp8.md)::

    stage 1 fwd   count exchange, layout; x rows -> pools; h = q(pool) q(W1)^T
    stage 2 fwd   o = q(swiglu(h)) q(W2)^T; (w o) rows -> their sources; y = sum over K (fp32)
    stage 2 bwd   dy rows -> pools; da = q(pool) q(W2^T)^T; SwiGLU bwd; dW2 = q(pool)^T q(w a)
    stage 1 bwd   x rows -> pools again (never saved); dx rows = q(dh) q(W1^T)^T -> their sources
                  with d(weight); dx = sum over K; dW1 = q(dh)^T q(pool)

Rows move in bf16 and are quantised on the expert's rank, which is bit-identical to quantising at the
source (rowwise blocks commute with moving rows).
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm import launch, transport
from megamoe.backends.symm.backend import SymmBackend
from megamoe.backends.symm.ops import SymmState, eager_plan, state_of
from megamoe.backends.triton_mx.experts import MXExperts, check_widths, row_plan

_SYMM = SymmBackend()


def stage1_forward(
    experts: MXExperts, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, state: SymmState
) -> tuple[Tensor | None, ...]:
    """``(h [P, 2I], dispatch_weights [P], None, *plan tensors)``."""
    check_widths(x_TH.shape[1], w1_G2IH.shape[1] // 2)
    x, weights_TK = x_TH.contiguous(), topk_weights_TK.contiguous()
    plan = eager_plan(state, x)
    _SYMM.exchange(plan, x, weights_TK)
    weights = transport.fill_pool(plan, x, weights_TK)
    h = experts.gemm1(plan.ws.view("pool"), w1_G2IH, row_plan(plan.recv), None)
    launch.check(plan.ws)
    return (h, weights, None, *state_of(plan))


def stage2_forward(
    experts: MXExperts, h_P2I: Tensor, dispatch_weights_P: Tensor, w2_GHI: Tensor, state: SymmState
) -> Tensor:
    plan = eager_plan(state, h_P2I.new_empty(0, w2_GHI.shape[1]))
    transport.begin(plan)
    o = experts.gemm2(h_P2I.contiguous(), w2_GHI, row_plan(plan.recv))
    transport.return_rows(plan, o, row_scale_P=dispatch_weights_P)
    y = transport.combine_rows(plan)
    launch.check(plan.ws)
    return y


def stage2_backward(
    experts: MXExperts,
    h_P2I: Tensor,
    dispatch_weights_P: Tensor,
    w2_GHI: Tensor,
    state: SymmState,
    dy_TH: Tensor,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    need_dh, need_dweights, need_dw2 = needs_grad
    dy = dy_TH.to(h_P2I.dtype).contiguous()
    plan = eager_plan(state, dy)
    transport.begin(plan, dy)
    transport.fill_pool(plan, dy)  # every rank sends its dy: a peer may need it whatever this rank needs
    dh, d_weights, dw2 = experts.gemm2_backward(
        h_P2I.contiguous(),
        dispatch_weights_P.contiguous(),
        w2_GHI,
        row_plan(plan.recv),
        plan.ws.view("pool"),
        None,
        need_dw2,
    )
    launch.check(plan.ws)
    return (
        dh if need_dh else None,
        d_weights.to(dispatch_weights_P.dtype) if need_dweights else None,
        dw2,
    )


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
    transport.fill_pool(plan, x)  # the dispatched x again, for dW1 (a peer's may need it, so always)
    dx_rows = experts.dgrad1(grad_h, w1_G2IH, rows)
    transport.return_rows(plan, dx_rows, scalar_P=grad_dispatch_weights_P)
    dx = transport.combine_rows(plan) if need_dx else None
    d_weights = transport.returned_scalars(plan, grad_dispatch_weights_P.dtype) if need_dweights else None
    dw1 = experts.wgrad1(grad_h, plan.ws.view("pool"), w1_G2IH, rows, None) if need_dw1 else None
    launch.check(plan.ws)
    return dx, d_weights, dw1
