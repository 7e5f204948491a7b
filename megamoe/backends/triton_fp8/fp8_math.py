"""Blockwise FP8 inside Triton kernels: float32 tile scales and E4M3 codes, bit-exact twins of
:mod:`megamoe.quant.fp8` (the tests compare bytes).

The amax is taken on the float32 bit patterns (an integer max orders magnitudes and puts NaN and
infinity on top, where a float max would drop a NaN), the scale and the scaled value by IEEE division
(``div_rn``: Triton's ``/`` is an approximate division on the GPU), and the E4M3 rounding by the
GPU's conversion instruction (``cvt.rn.satfinite``: round to nearest even, saturating). The CPU
interpreter's fp8 cast does not round to nearest, so interpreted kernels round with
:func:`~megamoe.backends.triton_mx.mx_math.e4m3_codes` instead: integer arithmetic with the same bits,
but about 25 integer operations an element, which would make the quantisers compute-bound on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from megamoe.backends.triton_mx.mx_math import abs_bits, e4m3_codes

TILE = 128
"""elements per scale (:data:`megamoe.quant.fp8.TILE`)."""
_CONVERT_ON_DEVICE = tl.constexpr(not isinstance(e4m3_codes, InterpretedFunction))
"""compiled kernels round with the hardware conversion; interpreted ones with :func:`e4m3_codes`."""


@triton.jit
def tile_scales(amax_bits):
    """float32 scales of tiles from the int32 bits of their amax: ``amax / 448`` (at least ``2**-126``),
    1 for an all-zero tile, NaN for a tile holding a NaN or an infinity (``bits >= 0x7F800000``)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.1754943508222875e-38)
    scale = tl.where(amax_bits == 0, 1.0, scale)
    return tl.where(amax_bits >= 0x7F800000, float("nan"), scale)


@triton.jit
def e4m3_of(v, scale):
    """E4M3 bytes (int32) of float32 ``v / scale``: IEEE division, round to nearest even, saturating;
    NaN -> ``0x7F`` with the quotient's sign bit."""
    q = tl.math.div_rn(v, scale)
    bits = q.to(tl.int32, bitcast=True)
    if _CONVERT_ON_DEVICE:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        return tl.where(q != q, 0x7F | ((bits >> 24) & 0x80), code)
    return e4m3_codes(bits, 0)


@triton.jit
def quantize_along_cols(v, TILES: tl.constexpr):
    """1×128 tiles along each row of float32 ``v [BR, TILES * 128]``: (E4M3 bytes, int32
    ``[BR, TILES * 128]``; scales ``[BR, TILES]``). Padding lanes must hold zeros."""
    tiles = v.reshape(v.shape[0], TILES, 128)
    scales = tile_scales(tl.max(abs_bits(tiles), axis=2))
    elements = e4m3_of(tiles, scales[:, :, None])
    return elements.reshape(v.shape[0], TILES * 128), scales


@triton.jit
def quantize_along_rows(v):
    """One 128-row tile down each column of float32 ``v [128, BX]``: (E4M3 bytes ``[128, BX]``, scales
    ``[BX]``). Padding lanes must hold zeros."""
    scales = tile_scales(tl.max(abs_bits(v), axis=0))
    return e4m3_of(v, scales[None, :]), scales


@triton.jit
def quantize_block(v):
    """One scale for the whole float32 tile ``v [BY, BX]`` (a 128×128 weight block): (E4M3 bytes, scale)."""
    scale = tile_scales(tl.max(tl.max(abs_bits(v), axis=1), axis=0))
    return e4m3_of(v, scale), scale
