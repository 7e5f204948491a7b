"""Blockwise FP8 at EP > 1 over the symmetric-memory workspace (``turbo_mega_moe_ep_transport: symm``).

Legend: T tokens, H hidden, I intermediate, K top-k, P pool rows (expert-major; past ``expert_start[G]``
padding).

The one-GPU FP8 kernels (:class:`~.experts.FP8Experts`) read the rows that
:mod:`megamoe.backends.symm.transport` moved: by row index from the broadcast copies (as the one-GPU
path gathers from ``x``), or from a filled pool. Device-side, static shapes: forward and backward
capture in a CUDA graph (the NCCL transport reads split sizes on the host and cannot). The plan is the
bf16 fused path's :class:`~megamoe.backends.symm.ops.SymmState`. The FP8 GEMMs have no remote epilogue,
so the rows they make go home in one more launch (:func:`~megamoe.backends.symm.transport.return_rows`)::

    stage 1 fwd   count exchange, layout; t(x) rowwise, its rows moved; h = t(x)[rows] b(W1)^T
    stage 2 fwd   o = t(swiglu(h)) b(W2)^T; each row * w sent to its source; y = sum over K (fp32)
    stage 2 bwd   dy rows moved; da = t(dy)[rows] b(W2^T)^T; SwiGLU bwd; dW2 = t(dy[rows])^T t(w a)
    stage 1 bwd   x rows moved again (never saved); t(dh) b(W1^T)^T in column ranges, each sent to the
                  sources (d(weight) with the first); dx = sum over K; dW1 = t(dh)^T t(x[rows])

The steps are :class:`~megamoe.backends.symm.quantized.QuantizedSymmBackend`'s, shared with the other
format; this module says how the rows go home (by ``return_rows`` after the FP8 GEMMs) and quantises
GEMM1's rows first.

The forward's rows are quantised rowwise at the source and move as one row each, E4M3 bytes with their
scales beside them (:func:`~megamoe.backends.triton_fp8.quantize.quantize_rows_packed`: 1 + 4/128 bytes
an element against bf16's 2), through the workspace's bf16 rows; rowwise tiles commute with moving
rows, so the bits are those of quantising on the expert's rank. The backward moves bf16 ``dy`` and
``x`` rows: its weight gradients quantise them along R, in tiles that do not move with a row.
"""

from __future__ import annotations

from torch import Tensor

from megamoe.backends.symm import transport
from megamoe.backends.symm.backend import SymmPlan
from megamoe.backends.symm.quantized import QuantizedSymmBackend
from megamoe.backends.triton.quantized_experts import RowPlan
from megamoe.backends.triton_fp8.experts import FP8Experts
from megamoe.backends.triton_fp8.quantize import quantize_rows_packed, unpack_rows
from megamoe.quant.cache import WeightCache
from megamoe.quant.fp8 import FP8Tensor
from megamoe.settings import SymmSettings


class FP8SymmBackend(QuantizedSymmBackend):
    """Implements :class:`~megamoe.backends.base.ExpertBackend` for ``precision="fp8"`` at EP > 1 over
    symmetric memory, with the one-GPU FP8 kernels and their weight cache."""

    name = "triton_fp8_symm"
    experts: FP8Experts

    def __init__(self, settings: SymmSettings, weights: WeightCache | None = None) -> None:
        super().__init__(settings, FP8Experts(weights))

    def rows_to_send(self, x_TH: Tensor) -> Tensor:
        """``t(x)`` rowwise at the source, each row's scales beside its E4M3 bytes."""
        return quantize_rows_packed(x_TH)

    def gemm1_rows(self, rows: Tensor, pool: RowPlan, index: Tensor | None, hidden: int) -> FP8Tensor:
        return unpack_rows(rows, hidden)

    def gemm2_home(
        self, plan: SymmPlan, h_P2I: Tensor, weights_P: Tensor, w2_GHI: Tensor, pool: RowPlan
    ) -> None:
        transport.return_rows(plan, self.experts.gemm2(h_P2I, w2_GHI, pool), row_scale_P=weights_P)

    def dgrad1_home(
        self, plan: SymmPlan, grad_h_P2I: Tensor, w1_G2IH: Tensor, pool: RowPlan, grad_weights_P: Tensor
    ) -> None:
        """The rows in fc1-dgrad's column ranges, each range sent as it is made (``d(weight)`` with the
        first, the flag with the last)."""
        hidden, sent = w1_G2IH.shape[2], []

        def home(dx_rows: Tensor, first: int) -> None:
            transport.return_rows(
                plan,
                dx_rows,
                first_column=first,
                scalar_P=None if sent else grad_weights_P,
                last=first + dx_rows.shape[1] == hidden,
            )
            sent.append(first)

        self.experts.dgrad1(grad_h_P2I, w1_G2IH, pool, home)
        if not sent:  # no rows here (or no columns): the peers still wait for this rank's flag
            home(grad_h_P2I.new_empty(grad_h_P2I.shape[0], hidden), 0)
