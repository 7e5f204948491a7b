"""The quantised expert math (MXFP8, FP8) over the symmetric-memory workspace: what both formats share.

Each format's module (:mod:`megamoe.backends.triton_mx.ep_symm`, :mod:`megamoe.backends.triton_fp8.ep_symm`)
subclasses :class:`QuantizedSymmBackend` with the steps whose rows go home differently (from the MX
GEMMs' remote epilogue, or by :func:`~megamoe.backends.symm.transport.return_rows` after the FP8 GEMMs).
Stage 2's backward is the same for both: ``dy`` rows moved, then the format's GEMM, SwiGLU backward and
weight gradient on this rank (nothing goes home).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from megamoe.backends.symm import launch, transport
from megamoe.backends.symm.ops import SymmState, SymmStatePlans, eager_plan
from megamoe.settings import SymmSettings


class QuantizedSymmBackend(SymmStatePlans):
    """An :class:`~megamoe.backends.base.ExpertBackend` of ``experts`` (a format's one-GPU expert math,
    with its weight cache) over symmetric memory; subclasses add the other three steps."""

    def __init__(self, settings: SymmSettings, experts: Any) -> None:
        super().__init__(settings)
        self.experts = experts
        self.weight_cache = experts.weight_cache

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
