"""The FP8 expert computation on rows that are already on this rank, whatever moved them there.

Legend: R expert-sorted rows (static; rows past ``expert_start[G]`` are padding), H hidden,
I intermediate, G local experts, NB = ceil(R / 128) + G block slots of 128 rows along R.

The same steps as :class:`~megamoe.backends.triton_mx.experts.MXExperts`, in DeepSeek-V3's blockwise
format (the emulation's table, :mod:`megamoe.backends.quantized_reference`):

    fc1 fwd    h = t(x)[row_token] b(W1)^T          rowwise quantiser at the source (EP: t(x) travels), GEMM gathers rows
    fc2 fwd    o = t(a) b(W2)^T                     SwiGLU pass emits t(a)
    fc2 dgrad  da = t(dy)[row_token] b(W2^T)^T      fp32 out; SwiGLU backward emits dh, d_w, t(w a)
    fc2 wgrad  dW2 = t(dy)^T t(w a) along R         segment quantiser (dy gathered) + K-grouped GEMM
    fc1 dgrad  dx rows = t(dh) b(W1^T)^T            rowwise quantiser + GEMM in column ranges; the transport combines
    fc1 wgrad  dW1 = t(dh)^T t(x) along R           segment quantiser (x gathered) + K-grouped GEMM

On Hopper the M-grouped GEMMs run the warp-specialised Gluon kernel of :mod:`.wgmma_gemm` (fc1 fwd and
fc2 dgrad after a gather of the quantised rows) and the weight gradients that of :mod:`.wgmma_wgrad`,
elsewhere the Triton kernels; each pair gives the same bits.
The weight gradients write every element, so their outputs start uninitialised (no memset pass).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megamoe.backends.triton.configs import column_chunks, num_programs
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.padding import zero_padding_rows
from megamoe.backends.triton.quantized_experts import QuantizedExperts, RowPlan
from megamoe.backends.triton.rows import Rows
from megamoe.backends.triton_fp8.configs import GPU_WGMMA, GPU_WGMMA_WGRAD, gemm_config, wgrad_config
from megamoe.backends.triton_fp8.fp8_math import TILE
from megamoe.backends.triton_fp8.grouped_gemm import fp8_grouped_gemm
from megamoe.backends.triton_fp8.quantize import (
    gather_rows,
    quantize_rows,
    quantize_segments,
    rows_for_tma,
    segments_in,
)
from megamoe.backends.triton_fp8.swiglu import swiglu_backward_quant, swiglu_quant
from megamoe.backends.triton_fp8.weights import weight_cache
from megamoe.backends.triton_fp8.wgrad import fp8_wgrad
from megamoe.quant.fp8 import FP8Tensor

try:  # Gluon (triton.experimental.gluon) with Hopper's warpgroup MMA; other builds use the Triton GEMMs
    from megamoe.backends.triton_fp8 import wgmma_gemm, wgmma_wgrad
except ImportError:
    wgmma_gemm = wgmma_wgrad = None


def dgrad1_columns(rows: int, cols: int, weight_rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of fc1-dgrad's ``cols`` output columns, as few as keep a range's ``rows``
    rows within dW1's ``weight_rows x cols`` elements (up to rounding each width but the last to a
    multiple of 128, a weight block's)."""
    count = max(1, cdiv(rows, max(weight_rows, 1)))
    width = cdiv(cdiv(cols, count), TILE) * TILE
    return [(start, min(start + width, cols)) for start in range(0, cols, width)]


class FP8Experts(QuantizedExperts):
    """The FP8 GEMMs, SwiGLU passes and wgrads of the expert stages."""

    name = "triton_fp8"
    precision = "fp8"
    block = TILE
    quantize_rows = staticmethod(quantize_rows)
    quantize_segments = staticmethod(quantize_segments)
    swiglu_backward_quant = staticmethod(swiglu_backward_quant)
    default_weight_cache = staticmethod(weight_cache)

    def _gemm(self, a: FP8Tensor, b: FP8Tensor, out: Tensor, plan: RowPlan, a_rows: Tensor | None) -> None:
        """``out = a[a_rows] b^T`` over the plan's tiles. On Hopper, the warp-specialised Gluon kernel
        after gathering the quantised rows (one byte an element, a copy at memory speed; rows that came
        packed with their scales are laid out for TMA the same way); elsewhere the Triton kernel, which
        gathers them itself and reads any row stride."""
        device = out.device
        if wgmma_gemm is not None and wgmma_gemm.supported(device):
            a = gather_rows(a, a_rows) if a_rows is not None else rows_for_tma(a)
            wgmma_gemm.wgmma_fp8_grouped_gemm(
                a, b, out, plan.routing, config=GPU_WGMMA, num_sms=num_programs(device)
            )
            return
        fp8_grouped_gemm(
            a,
            b,
            out,
            plan.routing,
            config=gemm_config(device, gather=a_rows is not None),
            num_sms=num_programs(device),
            a_rows=a_rows,
        )

    def _wgrad(self, p: FP8Tensor, q: FP8Tensor, out: Tensor, plan: RowPlan) -> Tensor:
        """``out = P^T Q`` per expert, every element written (zeros for an expert without rows): on Hopper
        by the warp-specialised Gluon kernel, elsewhere by the Triton kernel (the same bits)."""
        device = out.device
        if wgmma_wgrad is not None and wgmma_gemm.supported(device):
            wgmma_wgrad.wgmma_fp8_wgrad(
                p, q, out, plan.block_start_G1, config=GPU_WGMMA_WGRAD, num_sms=num_programs(device)
            )
            return out
        fp8_wgrad(p, q, out, plan.block_start_G1, config=wgrad_config(device), num_sms=num_programs(device))
        return out

    @staticmethod
    def _wgrad_block_n(device: torch.device) -> int:
        """Columns of a weight-gradient tile, by the kernel :meth:`_wgrad` runs on ``device``."""
        if wgmma_wgrad is not None and wgmma_gemm.supported(device):
            return GPU_WGMMA_WGRAD.block_n
        return wgrad_config(device).block_n

    @staticmethod
    def dispatch_rows(x_TH: Tensor, moved: Rows) -> FP8Tensor:
        """``t(x)``, quantised rowwise at the source, moved as E4M3 bytes and scales."""
        return moved.quantized_tokens_in(quantize_rows(x_TH.contiguous()))

    def gemm1(
        self,
        rows: FP8Tensor,
        w1_G2IH: Tensor,
        plan: RowPlan,
        a_rows: Tensor | None,
        row_values: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``h [R, 2I] = t(x) b(W1)^T`` from :meth:`dispatch_rows`'s rows, padding rows zero;
        ``row_values = (values_S, row_slot_R, out_R)``: also each row's value from its slot
        (:func:`~megamoe.backends.triton.padding.zero_padding_rows`'s, in the same launch)."""
        r = plan.routing
        h = w1_G2IH.new_empty(r.num_rows, w1_G2IH.shape[1])  # x's dtype (the ops check they agree)
        if h.numel():
            self._gemm(rows, self._w(w1_G2IH, transposed=False), h, plan, a_rows)
        zero_padding_rows(r.expert_start_G1, h, row_values=row_values)
        return h

    def gemm2(self, h_R2I: Tensor, w2_GHI: Tensor, plan: RowPlan) -> Tensor:
        """``o [R, H] = t(swiglu(h)) b(W2)^T`` (the combine's input, unweighted; padding rows not written)."""
        o = h_R2I.new_empty(h_R2I.shape[0], w2_GHI.shape[1])
        if o.numel():
            self._gemm(
                swiglu_quant(h_R2I, plan.valid_rows_1), self._w(w2_GHI, transposed=False), o, plan, None
            )
        return o

    def dgrad1(
        self, grad_h_R2I: Tensor, w1_G2IH: Tensor, plan: RowPlan, sink: Callable[[Tensor, int], None]
    ) -> None:
        """``dx rows [R, H] = t(dh) b(W1^T)^T`` handed to ``sink`` in column ranges (padding rows not
        written). A range's rows are no larger than dW1, so they and the rowwise ``t(dh)`` beside them
        stay under dW1's wgrad, where ``t(dh)`` along R (about as large) sits beside dW1."""
        R, H = grad_h_R2I.shape[0], w1_G2IH.shape[2]
        if not R * H:
            return
        g_rows = self.rowwise(grad_h_R2I, plan, None)
        w = self._w(w1_G2IH, transposed=True)

        def columns(start: int, end: int) -> Tensor:
            out = grad_h_R2I.new_empty(R, end - start)
            self._gemm(g_rows, w.narrow(1, start, end - start), out, plan, None)
            return out

        for start, end in dgrad1_columns(R, H, w1_G2IH.numel() // H):
            sink(columns(start, end), start)  # no name holds a range: it is freed before the next is made

    def wgrad1(
        self,
        grad_h_R2I: Tensor,
        rows: Tensor,
        w1_G2IH: Tensor,
        plan: RowPlan,
        a_rows: Tensor | None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        """``dW1 = t(dh)^T t(x)``, both along R. With ``scratch`` (``grad_h_R2I`` itself when no one reads
        it after this call), ``t(x)`` is made whole in its bytes once ``t(dh)`` is made, if it fits: one
        wgrad, and no buffer for it beside dW1. Otherwise ``t(x)`` is made and used in column chunks
        (:func:`~megamoe.backends.triton.configs.column_chunks`), so it never lives whole beside dW1.
        Each column's 1×128 tiles along R are the same in a chunk as in the whole: the same bits."""
        dw1 = torch.empty_like(w1_G2IH)
        R, H = grad_h_R2I.shape[0], rows.shape[1]
        if not R:
            return dw1.zero_()
        p = self._along_r(grad_h_R2I, plan, None)  # the last read of grad_h
        in_scratch = None if scratch is None else segments_in(scratch, H, plan.num_blocks)
        if in_scratch is not None:
            return self._wgrad(p, self._along_r(rows, plan, a_rows, out=in_scratch), dw1, plan)
        for columns in column_chunks(R, H, 1, self._wgrad_block_n(dw1.device)):
            q = self._along_r(rows[:, slice(*columns)], plan, a_rows)
            self._wgrad(p, q, dw1[:, :, slice(*columns)], plan)
            del q
        return dw1
