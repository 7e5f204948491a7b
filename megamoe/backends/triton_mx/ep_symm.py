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

The steps are :class:`~megamoe.backends.symm.quantized.QuantizedSymmBackend`'s, shared with the other
format; this module says how the rows go home (from the MX GEMMs' remote epilogues).

Rows move in bf16 and are quantised on the expert's rank, which is bit-identical to quantising at the
source (rowwise blocks commute with moving rows).
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm.backend import SymmPlan
from megamoe.backends.symm.quantized import QuantizedSymmBackend
from megamoe.backends.symm.workspace import STATE_DONE
from megamoe.backends.triton.quantized_experts import RowPlan
from megamoe.backends.triton_mx.experts import MXExperts
from megamoe.backends.triton_mx.grouped_gemm import RemoteRows
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


class MXFP8SymmBackend(QuantizedSymmBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="mxfp8"`` at EP > 1
    over symmetric memory, with the one-GPU MX kernels of :class:`MXFP8TritonBackend`'s weight cache."""

    name = "triton_mxfp8_symm"
    experts: MXExperts

    def __init__(self, settings: SymmSettings, weights: WeightCache | None = None) -> None:
        super().__init__(settings, MXExperts(weights))

    def gemm2_home(
        self, plan: SymmPlan, h_P2I: Tensor, weights_P: Tensor, w2_GHI: Tensor, pool: RowPlan
    ) -> None:
        self.experts.gemm2(h_P2I, w2_GHI, pool, _to_sources(plan, row_scale_P=weights_P))

    def dgrad1_home(
        self, plan: SymmPlan, grad_h_P2I: Tensor, w1_G2IH: Tensor, pool: RowPlan, grad_weights_P: Tensor
    ) -> None:
        self.experts.dgrad1(grad_h_P2I, w1_G2IH, pool, remote=_to_sources(plan, scalar_P=grad_weights_P))
