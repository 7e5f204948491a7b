"""Quantised expert precisions: the number formats, and quantised weights cached per optimizer step.

* :mod:`megamoe.quant.mx` — OCP MX blocks (32 elements, E8M0 scale, E4M3 data), ``precision="mxfp8"``.
* :mod:`megamoe.quant.fp8` — DeepSeek-V3's blockwise FP8 (1×128 tiles, 128×128 weight blocks, float32
  scales, E4M3 data), ``precision="fp8"``.
* :mod:`megamoe.quant.recipes` — which quantised form each GEMM operand takes, per precision.
* :mod:`megamoe.quant.cache` — :class:`WeightCache` and :func:`advance_weight_generation`, which the
  trainer calls once after each optimizer step.

The expert path uses them through ``fused_mega_moe(..., precision="mxfp8" | "fp8")``; the exact
emulation of both is :mod:`megamoe.backends.quantized_reference`.
"""

from megamoe.quant.cache import WeightCache, advance_weight_generation, weight_generation
from megamoe.quant.fp8 import (
    FP8Tensor,
    fake_quantize_fp8,
    fake_quantize_fp8_blocks,
    quantize_fp8,
    quantize_fp8_blocks,
    tile_scales,
)
from megamoe.quant.mx import (
    BLOCK,
    E4M3_MAX,
    MXTensor,
    block_scale_codes,
    dequantize_mx,
    e8m0_to_float,
    fake_quantize_mx,
    quantize_e4m3,
    quantize_mx,
)
from megamoe.quant.precision import check_precision

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8Tensor",
    "MXTensor",
    "WeightCache",
    "advance_weight_generation",
    "block_scale_codes",
    "check_precision",
    "dequantize_mx",
    "e8m0_to_float",
    "fake_quantize_fp8",
    "fake_quantize_fp8_blocks",
    "fake_quantize_mx",
    "quantize_e4m3",
    "quantize_fp8",
    "quantize_fp8_blocks",
    "quantize_mx",
    "tile_scales",
    "weight_generation",
]
