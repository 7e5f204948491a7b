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
from dataclasses import dataclass

import torch
from torch import Tensor

from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.padding import zero_padding_rows
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton.rows import Rows
from megamoe.backends.triton_mx.configs import gemm_config, wgrad_block_align, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import RemoteRows, mx_grouped_gemm
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_segments, segment_block_starts
from megamoe.backends.triton_mx.swiglu import swiglu_backward_quant, swiglu_quant
from megamoe.backends.triton_mx.weights import weight_cache
from megamoe.backends.triton_mx.wgrad import mx_wgrad
from megamoe.errors import UnsupportedSettingError
from megamoe.quant.cache import WeightCache
from megamoe.quant.mx import BLOCK, MXTensor


@dataclass(frozen=True, slots=True)
class RowPlan:
    """The rows' routing over the local experts and the wgrad's block slots along R."""

    routing: RoutingPlan
    block_start_G1: Tensor
    """first block slot of each expert's rows (``ceil(rows / 32)`` slots each), on the device."""
    num_blocks: int
    """static bound on the block slots: ``ceil(R / 32) + G * block_align``."""
    block_align: int
    """each expert's first block slot is a multiple of this (:data:`~.configs.WGRAD_BLOCK_ALIGN` on CUDA)."""

    @property
    def valid_rows_1(self) -> Tensor:
        return self.routing.expert_start_G1[-1:]


def row_plan(routing: RoutingPlan) -> RowPlan:
    """The block slots of ``routing``'s rows (one small device launch, no host sync)."""
    align = wgrad_block_align(routing.expert_start_G1.device)
    num_blocks = -(-routing.num_rows // BLOCK) + routing.num_experts * align
    return RowPlan(routing, segment_block_starts(routing.expert_start_G1, align=align), num_blocks, align)


def check_widths(hidden: int, inter: int) -> None:
    for name, value in (("hidden size H", hidden), ("intermediate size I", inter)):
        if value % 16:
            raise UnsupportedSettingError(
                name,
                value,
                "the MXFP8 Triton kernels read E4M3 rows by TMA, which needs 16-byte row strides",
                "Use a multiple of 16, or backend='reference' with precision='mxfp8'",
            )


class MXExperts:
    """The MX GEMMs, SwiGLU passes and wgrads of the expert stages (docs/mxfp8.md's table).

    ``rows`` arguments are ``[T, H]`` read through ``a_rows [R]``, or ``[R, H]`` in row order when
    ``a_rows`` is None.
    """

    name = "triton_mxfp8"

    def __init__(self, weights: WeightCache | None = None) -> None:
        self.weight_cache = weights if weights is not None else weight_cache()

    row_plan = staticmethod(row_plan)
    check_widths = staticmethod(check_widths)

    def _w(self, w_GYX: Tensor, *, transposed: bool) -> MXTensor:
        return self.weight_cache.get(w_GYX, transposed=transposed)

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

    def _along_r(self, src: Tensor, plan: RowPlan, index_R: Tensor | None) -> MXTensor:
        r = plan.routing
        return quantize_segments(
            src, r.expert_start_G1, plan.block_start_G1, plan.num_blocks, index_R=index_R
        )

    @staticmethod
    def _quantize(rows: Tensor, plan: RowPlan, a_rows: Tensor | None) -> MXTensor:
        """Rowwise MX of the rows a GEMM reads (in row order: the valid ones only)."""
        return quantize_rows(rows, valid_rows_1=None if a_rows is not None else plan.valid_rows_1)

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
            self._gemm(
                self._quantize(rows, plan, a_rows), self._w(w1_G2IH, transposed=False), h, plan, a_rows
            )
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

    def gemm2_backward(
        self,
        h_R2I: Tensor,
        weights_R: Tensor,
        w2_GHI: Tensor,
        plan: RowPlan,
        dy_rows: Tensor,
        a_rows: Tensor | None,
        need_dw2: bool,
        dh_over_h: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(dh [R, 2I], d_weights [R] fp32, dW2 or None)`` from ``dy``'s rows; padding rows zero.
        ``dh_over_h``: write ``dh`` over ``h`` (the SwiGLU backward reads each element before writing it)."""
        r = plan.routing
        R, inter = h_R2I.shape[0], h_R2I.shape[1] // 2
        dh = h_R2I if dh_over_h else h_R2I.new_empty(R, 2 * inter)
        d_weights = torch.empty(R, dtype=torch.float32, device=h_R2I.device)
        if not R:
            return dh, d_weights, torch.zeros_like(w2_GHI) if need_dw2 else None
        da = torch.empty(R, inter, dtype=torch.float32, device=h_R2I.device)
        self._gemm(self._quantize(dy_rows, plan, a_rows), self._w(w2_GHI, transposed=True), da, plan, a_rows)
        aw = swiglu_backward_quant(
            h_R2I, da, weights_R, dh, d_weights, r.expert_start_G1, plan.block_start_G1, plan.num_blocks
        )
        del da  # fp32 [R, I]: freed before dW2 and its operand are allocated (less at the peak)
        dw2 = None
        if need_dw2:
            dw2 = self._wgrad(self._along_r(dy_rows, plan, a_rows), aw, torch.empty_like(w2_GHI), plan)
        return dh, d_weights, dw2

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
            g_rows = quantize_rows(grad_h_R2I, valid_rows_1=plan.valid_rows_1)
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
