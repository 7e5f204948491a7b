"""What the quantised formats' expert math shares (:class:`~megamoe.backends.triton_fp8.experts.FP8Experts`,
:class:`~megamoe.backends.triton_mx.experts.MXExperts`): the rows' block tables along R, the width check,
the weight cache, and fc2's backward, whose dgrad, SwiGLU backward and dW2 differ only in the format's
kernels.

Legend: R expert-sorted rows (static; rows past ``expert_start[G]`` are padding), H hidden,
I intermediate, G local experts, NB block slots along R (``ceil(R / block) + G * align``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton.segments import block_starts
from megamoe.errors import UnsupportedSettingError
from megamoe.quant.cache import WeightCache


@dataclass(frozen=True, slots=True)
class RowPlan:
    """The rows' routing over the local experts and the weight gradients' block slots along R."""

    routing: RoutingPlan
    block_start_G1: Tensor
    """first block slot of each expert's rows (``ceil(rows / block)`` slots each, rounded up to a
    multiple of ``block_align``), on the device."""
    num_blocks: int
    """static bound on the block slots: ``ceil(R / block) + G * block_align``."""
    block_align: int = 1
    """each expert's first block slot is a multiple of this."""

    @property
    def valid_rows_1(self) -> Tensor:
        return self.routing.expert_start_G1[-1:]


class QuantizedExperts:
    """The steps both formats take alike. A subclass names its format's kernels (the class attributes
    below) and says how a GEMM and a weight gradient run (:meth:`_gemm`, :meth:`_wgrad`).

    ``rows`` arguments are ``[T, H]`` read through ``a_rows [R]``, or ``[R, H]`` in row order when
    ``a_rows`` is None.
    """

    name: ClassVar[str]
    precision: ClassVar[str]
    """the ``precision`` setting that selects the format (named in errors)."""
    block: ClassVar[int]
    """rows of one block along R: a weight gradient's operand tile."""
    quantize_rows: ClassVar[Callable[..., Any]]
    """``(src [R, X], *, valid_rows_1)``: the format's rowwise quantiser."""
    quantize_segments: ClassVar[Callable[..., Any]]
    """``(src, row_start_G1, block_start_G1, num_blocks, *, index_R, out)``: its along-R quantiser."""
    swiglu_backward_quant: ClassVar[Callable[..., Any]]
    """``(h, da, weight, dh, d_weight, row_start_G1, block_start_G1, num_blocks)``: the SwiGLU backward
    that also emits ``w a`` along R (dW2's operand)."""
    default_weight_cache: ClassVar[Callable[[], WeightCache]]

    def __init__(self, weights: WeightCache | None = None) -> None:
        self.weight_cache = weights if weights is not None else self.default_weight_cache()

    @staticmethod
    def block_align(device: torch.device) -> int:
        """The weight gradient's K step in blocks on ``device``: each expert's block slots are padded to it."""
        return 1

    @classmethod
    def row_plan(cls, routing: RoutingPlan) -> RowPlan:
        """The block slots of ``routing``'s rows (one small device launch, no host sync)."""
        align = cls.block_align(routing.expert_start_G1.device)
        num_blocks = -(-routing.num_rows // cls.block) + routing.num_experts * align
        starts = block_starts(routing.expert_start_G1, block=cls.block, align=align)
        return RowPlan(routing, starts, num_blocks, align)

    @classmethod
    def check_widths(cls, hidden: int, inter: int) -> None:
        for name, value in (("hidden size H", hidden), ("intermediate size I", inter)):
            if value % 16:
                raise UnsupportedSettingError(
                    name,
                    value,
                    f"the {cls.precision.upper()} Triton kernels read E4M3 rows by TMA, which needs "
                    "16-byte row strides",
                    f"Use a multiple of 16, or backend='reference' with precision='{cls.precision}'",
                )

    def _w(self, w_GYX: Tensor, *, transposed: bool) -> Any:
        return self.weight_cache.get(w_GYX, transposed=transposed)

    def _gemm(self, a: Any, b: Any, out: Tensor, plan: RowPlan, a_rows: Tensor | None) -> None:
        """``out = a[a_rows] b^T`` over the plan's tiles."""
        raise NotImplementedError

    def _wgrad(self, p: Any, q: Any, out: Tensor, plan: RowPlan) -> Tensor:
        """``out = P^T Q`` per expert from two along-R operands, every element written; returns ``out``."""
        raise NotImplementedError

    def _along_r(self, src: Tensor, plan: RowPlan, index_R: Tensor | None, out: Any = None) -> Any:
        """``src``'s rows (``src[index_R]`` with ``index_R``) quantised along R per expert, packed."""
        r = plan.routing
        return self.quantize_segments(
            src, r.expert_start_G1, plan.block_start_G1, plan.num_blocks, index_R=index_R, out=out
        )

    def rowwise(self, rows: Tensor, plan: RowPlan, a_rows: Tensor | None) -> Any:
        """Rowwise tiles of the rows a GEMM reads (in row order: the valid ones only)."""
        return self.quantize_rows(rows, valid_rows_1=None if a_rows is not None else plan.valid_rows_1)

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
        self._gemm(self.rowwise(dy_rows, plan, a_rows), self._w(w2_GHI, transposed=True), da, plan, a_rows)
        aw = self.swiglu_backward_quant(
            h_R2I, da, weights_R, dh, d_weights, r.expert_start_G1, plan.block_start_G1, plan.num_blocks
        )
        del da  # fp32 [R, I]: freed before dW2 and its operand are allocated (less at the peak)
        dw2 = None
        if need_dw2:
            dw2 = self._wgrad(self._along_r(dy_rows, plan, a_rows), aw, torch.empty_like(w2_GHI), plan)
        return dh, d_weights, dw2
