"""The MXFP8 expert computation on rows that are already on this rank, whatever moved them there.

Legend: R expert-sorted rows (static; rows past ``expert_start[G]`` are padding), H hidden,
I intermediate, G local experts, NB = ceil(R / 32) + G * align block slots along R.

Two transports feed it: :mod:`megamoe.backends.quantized_triton` (one GPU, or NCCL's ``TokenExchange`` at EP > 1) and
:mod:`.ep_symm` (the symmetric-memory workspace at EP > 1). Each step reads its rows either through a
row index (``a_rows``: the one-GPU path's fused dispatch gather) or in row order (a pool the
transport already filled), and writes per-row outputs; the transport does the combine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.padding import zero_padding_rows
from megamoe.backends.triton.quantized_experts import QuantizedExperts, RowPlan
from megamoe.backends.triton.rows import Rows
from megamoe.backends.triton_mx.configs import gemm_config, wgrad_block_align, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import RemoteRows, mx_grouped_gemm
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_segments
from megamoe.backends.triton_mx.swiglu import swiglu_backward_quant, swiglu_quant
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.backends.triton_mx.wgrad import mx_wgrad
from megamoe.quant.mx import BLOCK, MXTensor


class MXExperts(QuantizedExperts):
    """The MX GEMMs, SwiGLU passes and wgrads of the expert stages (docs/mxfp8.md's table)."""

    name = "triton_mxfp8"
    precision = "mxfp8"
    block = BLOCK
    quantize_rows = staticmethod(quantize_rows)
    quantize_segments = staticmethod(quantize_segments)
    swiglu_backward_quant = staticmethod(swiglu_backward_quant)
    default_weight_cache = staticmethod(weight_cache)
    block_align = staticmethod(wgrad_block_align)

    def _gemm(
        self,
        a: MXTensor,
        b: MXTensor,
        out: Tensor | None,
        plan: RowPlan,
        a_rows: Tensor | None,
        remote: RemoteRows | None = None,
    ) -> None:
        device = a.data.device
        mx_grouped_gemm(
            a,
            b,
            out,
            plan.routing,
            config=gemm_config(device),
            num_sms=num_programs(device),
            a_rows=a_rows,
            remote=remote,
        )

    def _wgrad(self, p: MXTensor, q: MXTensor, out: Tensor, plan: RowPlan) -> Tensor:
        mx_wgrad(
            p,
            q,
            out,
            plan.block_start_G1,
            config=wgrad_config(out.device),
            num_sms=num_programs(out.device),
            block_align=plan.block_align,
        )
        return out

    @staticmethod
    def dispatch_rows(x_TH: Tensor, moved: Rows) -> Tensor:
        """bf16 rows travel; :meth:`gemm1` quantises them where they land."""
        return moved.tokens_in(x_TH)

    def gemm1(
        self,
        rows: Tensor,
        w1_G2IH: Tensor,
        plan: RowPlan,
        a_rows: Tensor | None,
        row_values: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``h [R, 2I] = q(x) q(W1)^T``, padding rows zero; ``row_values = (values_S, row_slot_R, out_R)``:
        also each row's value from its slot (:func:`~megamoe.backends.triton.padding.zero_padding_rows`'s,
        in the same launch)."""
        r = plan.routing
        h = rows.new_empty(r.num_rows, w1_G2IH.shape[1])
        if h.numel():
            self._gemm(self.rowwise(rows, plan, a_rows), self._w(w1_G2IH, transposed=False), h, plan, a_rows)
        zero_padding_rows(r.expert_start_G1, h, row_values=row_values)
        return h

    def gemm2(
        self, h_R2I: Tensor, w2_GHI: Tensor, plan: RowPlan, remote: RemoteRows | None = None
    ) -> Tensor | None:
        """``o [R, H] = q(swiglu(h)) q(W2)^T`` (the combine's input, unweighted; padding rows not written),
        or None with ``remote``: the rows went to their sources (times ``remote.row_scale_R``)."""
        o = None if remote else h_R2I.new_empty(h_R2I.shape[0], w2_GHI.shape[1])
        if remote or o.numel():  # (remote: every rank's GEMM signals, even one with no rows)
            a = swiglu_quant(h_R2I, plan.valid_rows_1)
            self._gemm(a, self._w(w2_GHI, transposed=False), o, plan, None, remote)
        return o

    def dgrad1(
        self,
        grad_h_R2I: Tensor,
        w1_G2IH: Tensor,
        plan: RowPlan,
        sink: Callable[[Tensor, int], None] | None = None,
        remote: RemoteRows | None = None,
    ) -> None:
        """``dx rows [R, H] = q(dh) q(W1^T)^T`` (padding rows not written), handed whole to ``sink``, or
        with ``remote`` sent to their sources (with ``remote.scalar_R``)."""
        out = None if remote else grad_h_R2I.new_empty(grad_h_R2I.shape[0], w1_G2IH.shape[2])
        if remote or out.numel():
            g_rows = self.rowwise(grad_h_R2I, plan, None)
            self._gemm(g_rows, self._w(w1_G2IH, transposed=True), out, plan, None, remote)
        if sink is not None and out is not None and out.numel():
            sink(out, 0)

    def wgrad1(
        self,
        grad_h_R2I: Tensor,
        rows: Tensor,
        w1_G2IH: Tensor,
        plan: RowPlan,
        a_rows: Tensor | None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        """``dW1 = q(dh)^T q(x)``, both along R (each in its own buffer: ``scratch`` is not used)."""
        if not grad_h_R2I.shape[0]:
            return torch.zeros_like(w1_G2IH)
        p = self._along_r(grad_h_R2I, plan, None)
        return self._wgrad(p, self._along_r(rows, plan, a_rows), torch.empty_like(w1_G2IH), plan)
