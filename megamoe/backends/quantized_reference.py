"""Exact emulation of the quantised expert paths (``mxfp8``, ``fp8``): the definition of correct for
their kernels.

Every expert GEMM quantises both operands as its precision's :class:`~megamoe.quant.recipes.QuantRecipe`
says, dequantises them (exactly; FP8's ``e4m3 * s`` rounds once in float32, below ``2**-24``
relative, and is exact in float64), and multiplies in float32 (float64 for float64 inputs). Parameters,
activations handed between the stages (``h``, ``dh``) and gradients stay in the inputs' dtype; routing
weights, SwiGLU and the top-k sums are computed in float32, as in the bf16 reference
(:mod:`megamoe.backends.reference`). Runs on CPU and GPU, EP over any process group through
:class:`~megamoe.backends.exchange.TokenExchange`. One class for both precisions; only the recipe differs.

Legend: T tokens, H hidden, I intermediate, G local experts, R dispatched rows (expert-major),
``a = swiglu(h)``, ``w_r`` the routing weight of row r.

``mxfp8`` (:mod:`megamoe.quant.mx`): ``q(M) along X`` = MX blocks of 32 of M along dimension X, one
E8M0 scale each.

==========  ===========================  ==========================  ===============================
GEMM        product                      left operand                right operand
==========  ===========================  ==========================  ===============================
fc1 fwd     ``h = x W1^T``               ``q(x)`` rowwise along H    ``q(W1)`` along H (cache)
fc2 fwd     ``o = a W2^T``               ``q(a)`` rowwise along I    ``q(W2)`` along I (cache)
fc2 dgrad   ``da = dy W2``               ``q(dy)`` rowwise along H   ``q(W2^T)`` along H (cache)
fc2 wgrad   ``dW2 = dy^T (w a)``         ``q(dy)`` along R           ``q(w a)`` along R
fc1 dgrad   ``dx = dh W1``               ``q(dh)`` rowwise along 2I  ``q(W1^T)`` along 2I (cache)
fc1 wgrad   ``dW1 = dh^T x``             ``q(dh)`` along R           ``q(x)`` along R
==========  ===========================  ==========================  ===============================

``fp8`` (:mod:`megamoe.quant.fp8`, DeepSeek-V3's recipe): ``t(M) along X`` = 1×128 tiles of M along
X, ``b(W)`` = 128×128 blocks of W over its last two dims, one float32 scale each.

==========  ===========================  ==========================  ===============================
GEMM        product                      left operand                right operand
==========  ===========================  ==========================  ===============================
fc1 fwd     ``h = x W1^T``               ``t(x)`` rowwise along H    ``b(W1)`` (cache)
fc2 fwd     ``o = a W2^T``               ``t(a)`` rowwise along I    ``b(W2)`` (cache)
fc2 dgrad   ``da = dy W2``               ``t(dy)`` rowwise along H   ``b(W2)^T`` (same cache entry)
fc2 wgrad   ``dW2 = dy^T (w a)``         ``t(dy)`` along R           ``t(w a)`` along R
fc1 dgrad   ``dx = dh W1``               ``t(dh)`` rowwise along 2I  ``b(W1)^T`` (same cache entry)
fc1 wgrad   ``dW1 = dh^T x``             ``t(dh)`` along R           ``t(x)`` along R
==========  ===========================  ==========================  ===============================

The dgrad weight is the forward one transposed: the 128×128 blocks of ``W^T`` are exactly the
transposed blocks of ``W``, so one quantisation (one cache entry, one pass per optimizer step) serves
both, and a kernel reads ``W^T`` through transposed descriptors over the same bytes.

* Rowwise quantisation of ``x`` and ``dy`` commutes with the token exchange (each row has its own
  scales), so a kernel may quantise at the source and send E4M3 rows + scales (half the bytes):
  the result is bit-identical to quantising here, after the exchange.
* Tiles along R start at each expert's first row (rows ``Bj .. Bj+B-1`` of that expert's group, B = 32
  or 128, the last one short): the GEMM sums within one expert, so a tile never straddles two.
* ``y = sum_k w o``, the combine and the routing-weight gradient ``dw_r = <da_r, a_r>`` stay in
  float32 from unquantised ``a``: no rounding to E4M3 on the combine path.
* Weight forms come from a :class:`~megamoe.quant.cache.WeightCache`, refreshed by
  :func:`~megamoe.quant.cache.advance_weight_generation`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import StagedBackend, swiglu, swiglu_backward
from megamoe.backends.exchange import TokenExchange
from megamoe.quant.cache import WeightCache
from megamoe.quant.recipes import FP8, MXFP8, QuantRecipe


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _per_expert_matmul(rows_RX: Tensor, weights_GYX: Tensor, counts: list[int]) -> Tensor:
    """``out[r] = rows[r] @ weights[expert(r)]^T``: ``[R, X] x [G, Y, X] -> [R, Y]``."""
    out = rows_RX.new_empty((rows_RX.shape[0], weights_GYX.shape[1]))
    for expert, (chunk, out_chunk) in enumerate(zip(rows_RX.split(counts), out.split(counts), strict=True)):
        if chunk.shape[0]:
            torch.matmul(chunk, weights_GYX[expert].t(), out=out_chunk)
    return out


def _per_expert_wgrad(left_RY: Tensor, right_RX: Tensor, counts: list[int]) -> Tensor:
    """``dW[g] = sum_{r in g} left[r]^T right[r]``: ``[R, Y], [R, X] -> [G, Y, X]`` (zero for empty experts)."""
    dw = left_RY.new_zeros((len(counts), left_RY.shape[1], right_RX.shape[1]))
    for expert, (l_chunk, r_chunk) in enumerate(
        zip(left_RY.split(counts), right_RX.split(counts), strict=True)
    ):
        if l_chunk.shape[0]:
            torch.matmul(l_chunk.t(), r_chunk, out=dw[expert])
    return dw


class QuantizedReferenceBackend(StagedBackend):
    """Per-expert float32 matmuls on dequantised operands (quantised as ``recipe`` says), around an
    ``all_to_all`` exchange."""

    def __init__(self, recipe: QuantRecipe, weight_cache: WeightCache | None = None) -> None:
        self.recipe = recipe
        self.name = f"{recipe.precision}_reference"
        self.weight_cache = weight_cache if weight_cache is not None else recipe.weight_cache()

    def _rowwise(self, rows_RX: Tensor, dtype: torch.dtype) -> Tensor:
        """Operand tiled along each row, dequantised to ``dtype``."""
        return self.recipe.operand(rows_RX, 1, dtype)

    def _along_rows(self, rows_RX: Tensor, counts: list[int], dtype: torch.dtype) -> Tensor:
        """Operand tiled along R inside each expert's rows (wgrad), dequantised to ``dtype``."""
        parts = [self.recipe.operand(chunk, 0, dtype) for chunk in rows_RX.split(counts)]
        return torch.cat(parts) if parts else rows_RX.to(dtype)

    def _weight(self, w_GYX: Tensor, *, transposed: bool, dtype: torch.dtype) -> Tensor:
        return self.recipe.weight(self.weight_cache, w_GYX, transposed=transposed, dtype=dtype)

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> TokenExchange:
        return TokenExchange.build(topk_idx_TK, num_experts=num_experts, group=group)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: TokenExchange
    ) -> tuple[Tensor, Tensor, None]:
        cdt = _compute_dtype(x_TH.dtype)
        x_RH = self._rowwise(plan.dispatch_tokens(x_TH), cdt)
        h_R2I = _per_expert_matmul(
            x_RH, self._weight(w1_G2IH, transposed=False, dtype=cdt), plan.tokens_per_expert
        )
        return h_R2I.to(x_TH.dtype), plan.dispatch_slot_values(topk_weights_TK), None

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: TokenExchange,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        counts = plan.tokens_per_expert
        cdt = _compute_dtype(x_TH.dtype)
        dx = d_weights = dw1 = None
        if need_dx:
            w1_t = self._weight(w1_G2IH, transposed=True, dtype=cdt)  # [G, H, 2I]
            dx_RH = _per_expert_matmul(self._rowwise(grad_h_R2I, cdt), w1_t, counts)
            dx = plan.combine_tokens(dx_RH, acc_dtype=cdt).to(x_TH.dtype)
        if need_dweights:
            d_weights = plan.combine_slot_values(grad_dispatch_weights_R)
        if need_dw1:
            x_RH = plan.dispatch_tokens(x_TH)  # recomputed: the forward kept only x
            dw1 = _per_expert_wgrad(
                self._along_rows(grad_h_R2I, counts, cdt), self._along_rows(x_RH, counts, cdt), counts
            )
            dw1 = dw1.to(w1_G2IH.dtype)
        return dx, d_weights, dw1

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TokenExchange,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        cdt = _compute_dtype(h_R2I.dtype)
        a_RI = self._rowwise(swiglu(h_R2I.to(cdt)), cdt)
        o_RH = _per_expert_matmul(
            a_RI, self._weight(w2_GHI, transposed=False, dtype=cdt), plan.tokens_per_expert
        )
        weighted = o_RH * dispatch_weights_R.to(cdt).unsqueeze(1)
        return plan.combine_tokens(weighted, acc_dtype=cdt).to(h_R2I.dtype)

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: TokenExchange,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        counts = plan.tokens_per_expert
        cdt = _compute_dtype(h_R2I.dtype)
        dy_RH = plan.dispatch_tokens(dy_TH.to(h_R2I.dtype))
        h_c = h_R2I.to(cdt)
        a_RI = swiglu(h_c)
        weights_R1 = dispatch_weights_R.to(cdt).unsqueeze(1)
        dh = d_weights = dw2 = None
        if need_dh or need_dweights:
            w2_t = self._weight(w2_GHI, transposed=True, dtype=cdt)  # [G, I, H]
            da_unweighted_RI = _per_expert_matmul(self._rowwise(dy_RH, cdt), w2_t, counts)
            if need_dweights:
                d_weights = (da_unweighted_RI * a_RI).sum(1).to(dispatch_weights_R.dtype)
            if need_dh:
                dh = swiglu_backward(h_c, da_unweighted_RI * weights_R1).to(h_R2I.dtype)
        if need_dw2:
            dw2 = _per_expert_wgrad(
                self._along_rows(dy_RH, counts, cdt), self._along_rows(a_RI * weights_R1, counts, cdt), counts
            )
            dw2 = dw2.to(w2_GHI.dtype)
        return dh, d_weights, dw2


class MXFP8ReferenceBackend(QuantizedReferenceBackend):
    """``precision="mxfp8"``: the emulation with MX operands."""

    def __init__(self, weight_cache: WeightCache | None = None) -> None:
        super().__init__(MXFP8, weight_cache)


class FP8ReferenceBackend(QuantizedReferenceBackend):
    """``precision="fp8"``: the emulation with blockwise FP8 operands."""

    def __init__(self, weight_cache: WeightCache | None = None) -> None:
        super().__init__(FP8, weight_cache)
