"""MXFP8 for the expert path: the MX format, and quantised weights cached per optimizer step.

* :mod:`megamoe.quant.mx` — OCP MX blocks (32 elements, E8M0 scale, E4M3 data): quantise, dequantise.
* :mod:`megamoe.quant.cache` — :class:`WeightCache` and :func:`advance_weight_generation`, which the
  trainer calls once after each optimizer step.

The expert path uses them through ``fused_mega_moe(..., precision="mxfp8")``; the exact emulation is
:mod:`megamoe.backends.mxfp8_reference`.
"""

from megamoe.quant.cache import WeightCache, advance_weight_generation, weight_generation
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
    "MXTensor",
    "WeightCache",
    "advance_weight_generation",
    "block_scale_codes",
    "check_precision",
    "dequantize_mx",
    "e8m0_to_float",
    "fake_quantize_mx",
    "quantize_e4m3",
    "quantize_mx",
    "weight_generation",
]
