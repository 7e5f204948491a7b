"""Which quantised form each expert-GEMM operand takes, per precision: the emulation's table as data.

The exact emulation (:mod:`megamoe.backends.quantized_reference`) runs the same six GEMMs for every
quantised precision and asks a :class:`QuantRecipe` only two things: the fake-quantised activation
or gradient operand (1×B tiles along its reduction dimension, or along R for wgrad), and the forward
(``W``) and dgrad (``W^T``) forms of an expert weight, from a :class:`~megamoe.quant.cache.WeightCache`.

* ``mxfp8``: 1×32 MX blocks for every operand. ``W`` and ``W^T`` are two cached forms, because blocks
  run along the reduction dimension, which is X for ``W [G, Y, X]`` and Y for ``W^T``.
* ``fp8``: 1×128 tiles for activations and gradients, 128×128 blocks for weights, float32 scales.
  One cached form serves both directions: the 128×128 blocks of ``W^T`` are the transposes of those
  of ``W``, element for element and scale for scale (a test pins it), so quantising ``W^T`` again
  would give the same numbers for a second pass and a second buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megamoe.quant.cache import QuantizedWeight, WeightCache
from megamoe.quant.fp8 import empty_fp8_blocks, fake_quantize_fp8, quantize_fp8_blocks
from megamoe.quant.mx import fake_quantize_mx


@dataclass(frozen=True, slots=True)
class QuantRecipe:
    """How one quantised precision quantises the operands of the expert GEMMs."""

    precision: str
    """the ``precision=`` value it implements."""
    operand: Callable[[Tensor, int, torch.dtype], Tensor]
    """``operand(values, dim, dtype)``: an activation or gradient operand, fake-quantised in 1×B tiles
    along ``dim`` and dequantised to ``dtype``."""
    weight_cache: Callable[[], WeightCache]
    """a new cache of this recipe's weight forms."""
    one_weight_form: bool
    """one cached quantisation of ``W`` also serves ``W^T`` (square blocks), instead of one form each."""

    def weight(self, cache: WeightCache, w_GYX: Tensor, *, transposed: bool, dtype: torch.dtype) -> Tensor:
        """``W [G, Y, X]`` or (``transposed``) ``W^T [G, X, Y]`` as the GEMM multiplies it, in ``dtype``."""
        if not self.one_weight_form:
            return cache.get(w_GYX, transposed=transposed).dequantize(dtype)
        w = cache.get(w_GYX, transposed=False).dequantize(dtype)
        return w.transpose(1, 2) if transposed else w


def _mx_operand(values: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    return fake_quantize_mx(values, dim).to(dtype)


def _fp8_operand(values: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    return fake_quantize_fp8(values, dim, dtype=dtype)


def _quantize_fp8_weight(source: Tensor, out: QuantizedWeight) -> None:
    quantize_fp8_blocks(source, out=out)


def _fp8_weight_cache() -> WeightCache:
    return WeightCache(quantize=_quantize_fp8_weight, empty=empty_fp8_blocks)


MXFP8 = QuantRecipe(precision="mxfp8", operand=_mx_operand, weight_cache=WeightCache, one_weight_form=False)
FP8 = QuantRecipe(precision="fp8", operand=_fp8_operand, weight_cache=_fp8_weight_cache, one_weight_form=True)
RECIPES = {recipe.precision: recipe for recipe in (MXFP8, FP8)}
"""the quantised precisions by name."""
