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
    segments_bytes,
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
        stay under dW1's wgrad (:meth:`wgrad1`)."""
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
        it after this call), ``t(dh)`` is moved into its first bytes once made (a copy at memory speed),
        before dW1 is allocated, and ``t(x)`` is made in the rest, whole or in as few column chunks as
        fit: nothing of the wgrad's operands lives beside dW1 but the bytes of ``dh`` itself, which
        autograd holds through this call anyway. Without scratch, ``t(x)`` is made and used in column
        chunks (:func:`~megamoe.backends.triton.configs.column_chunks`), so it never lives whole beside
        dW1. Each column's 1×128 tiles along R are the same in a chunk as in the whole: the same bits."""
        R, H = grad_h_R2I.shape[0], rows.shape[1]
        if not R:
            return torch.zeros_like(w1_G2IH)
        p = self._along_r(grad_h_R2I, plan, None)  # the last read of grad_h
        free = None
        if scratch is not None:
            p, free = _moved_into(p, scratch, plan.num_blocks)
        dw1 = torch.empty_like(w1_G2IH)
        block_n = self._wgrad_block_n(dw1.device)
        width = 0 if free is None else _columns_fitting(free, H, plan.num_blocks, block_n)
        chunks = (
            [(start, min(start + width, H)) for start in range(0, H, width)]
            if width
            else column_chunks(R, H, 1, block_n)
        )
        for start, end in chunks:
            into = segments_in(free, end - start, plan.num_blocks) if width else None
            q = self._along_r(rows[:, start:end], plan, a_rows, out=into)
            self._wgrad(p, q, dw1[:, :, start:end], plan)
            del q
        return dw1


def _moved_into(p: FP8Tensor, scratch: Tensor, num_blocks: int) -> tuple[FP8Tensor, Tensor]:
    """``(p, free)``: along-R operand ``p`` copied into the first bytes of ``scratch`` (the original freed
    once the caller drops it) and the bytes after it; ``p`` itself and all of ``scratch`` where it does
    not fit."""
    raw = scratch.view(-1).view(torch.uint8)
    cols = p.data.shape[0]
    used = segments_bytes(cols, num_blocks)
    moved = segments_in(raw[:used], cols, num_blocks)  # None where scratch is shorter
    if moved is None:
        return p, raw
    moved.data.copy_(p.data)
    moved.scale.copy_(p.scale)
    return moved, raw[used:]


def _columns_fitting(free: Tensor, cols: int, num_blocks: int, multiple: int) -> int:
    """The widest column chunk (all ``cols``, or a multiple of ``multiple``) whose along-R operand fits in
    ``free``'s bytes; 0 where not even ``multiple`` columns fit."""
    if segments_in(free, cols, num_blocks) is not None:
        return cols
    width = free.numel() // ((TILE + 4) * num_blocks) // multiple * multiple  # bytes of a column, unrounded
    while width and segments_in(free, width, num_blocks) is None:
        width -= multiple
    return width
