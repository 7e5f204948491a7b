"""The expert weights' FP8 forms for the FP8 kernels, through the shared :class:`WeightCache`.

``w [G, Y, X]`` in 128×128 blocks is the forward's B operand ``[G, N=Y, K=X]``. The dgrad multiplies
by ``w^T``, and Hopper's FP8 MMA reads B only K-major, so the cache keeps the transposed form too
(``transposed=True``: ``w^T [G, X, Y]`` contiguous). Its blocks are the transposes of ``w``'s, the
same numbers (:mod:`megamoe.quant.recipes`), so when the forms can be kept one pass over ``w`` writes
both (:func:`~megamoe.backends.triton_fp8.quantize.quantize_weight_both`): the forward's miss fills
the form its backward reads. A use that cannot be kept (before the first optimizer step, during
CUDA-graph capture) quantises the form it needs alone, the transposed one read through the view."""

from __future__ import annotations

from megamoe.backends.triton_fp8.quantize import empty_weight, quantize_weight, quantize_weight_both
from megamoe.quant.cache import WeightCache


def weight_cache() -> WeightCache:
    """A :class:`WeightCache` that quantises with the Triton block quantiser."""
    return WeightCache(quantize=quantize_weight, empty=empty_weight, quantize_both=quantize_weight_both)
