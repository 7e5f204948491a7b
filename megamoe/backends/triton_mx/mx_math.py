"""The MX format inside Triton kernels: E8M0 scale codes, E4M3 element codes, scale values.

Bit-exact twins of :mod:`megamoe.quant.mx` (the tests compare bytes), written in integer arithmetic on
the float32 bit pattern instead of hardware conversions, for two reasons:

* the Triton 3.6 CPU interpreter converts float32 to fp8 without ties-to-even (it rounds half up and
  truncates subnormals), so a ``.to(tl.float8e4nv)`` kernel could not be checked on the CPU;
* scaling a value by ``2**-e`` with a float multiply would lose fp32 subnormal inputs on a GPU that
  flushes denormals; here the block exponent is subtracted from the value's exponent, exactly.

The quantisers are memory-bound, so ~25 integer operations per element cost no time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0_codes(amax_bits):
    """E8M0 code (int32) of a block from the int32 bits of its float32 amax (``>= 0x7F800000``: NaN/inf).

    ``e`` = the smallest integer with ``amax <= 448 * 2**e``: the exponent minus 8, plus 1 when the
    mantissa exceeds 1.75 (``0x600000``), clamped to ``[-127, 127]``; zero -> 127, non-finite -> 255.
    """
    bump = ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    code = tl.minimum(tl.maximum((amax_bits >> 23) - 8 + bump, 0), 254)
    code = tl.where(amax_bits == 0, 127, code)
    return tl.where(amax_bits >= 0x7F800000, 255, code)


@triton.jit
def e4m3_codes(bits, e):
    """E4M3 byte (int32 0..255) of the float32 ``bits`` divided by ``2**e``: round to nearest even,
    saturating at ±448 (±inf too), NaN -> ``0x7F`` with the sign bit, as torch's conversion does.

    The value is ``full * 2**base`` with an integer ``full < 2**24``; the E4M3 quantum is
    ``2**Q`` with ``Q = max(floor(log2 v), -6) - 3``; the code is ``8 * (Q + 9) + round(v / 2**Q)``,
    which also carries a mantissa that rounds up into the next exponent, and covers subnormals.
    """
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp_bits = mag >> 23
    full = (mag & 0x7FFFFF) | tl.where(exp_bits > 0, 0x800000, 0)
    base = tl.maximum(exp_bits, 1) - 150 - e
    lead = (full.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2(full)), exact
    quantum = tl.maximum(base + lead, -6) - 3
    shift = quantum - base  # >= -3
    right = tl.minimum(tl.maximum(shift, 0), 25)  # full < 2**24: a shift of 25 leaves 0
    kept = full >> right
    rest = full - (kept << right)
    half = (1 << right) >> 1
    round_up = (right > 0) & ((rest > half) | ((rest == half) & ((kept & 1) == 1)))
    n = tl.where(shift < 0, full << tl.maximum(-shift, 0), kept + round_up.to(tl.int32))
    code = tl.minimum(8 * (quantum + 9) + n, 126)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def block_exponent(codes):
    """The exponent ``e`` a block's elements are divided by: ``code - 127``, 0 for the NaN code."""
    return tl.where(codes == 255, 0, codes - 127)


@triton.jit
def e8m0_to_float(codes):
    """Float32 value ``2**(code - 127)`` of E8M0 codes (any integer type), built from bits; 255 -> NaN."""
    c = codes.to(tl.int32)
    bits = tl.where(c == 0, 0x00400000, c << 23)  # 2**-127 is a float32 subnormal
    return tl.where(c == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def scale_tile(ptr, offs, mask, kb0, num_kb, stride_x, stride_b, NB: tl.constexpr):
    """fp32 scale values ``[len(offs), NB]`` of K blocks ``kb0 .. kb0 + NB`` whose codes sit at
    ``ptr + offs * stride_x + kb * stride_b``: one load per pipeline stage, not one per 32-deep step.
    Rows outside ``mask`` and blocks from ``num_kb`` on read code 127 (scale 1): no NaN from outside."""
    kbs = kb0 + tl.arange(0, NB)
    ptrs = ptr + offs[:, None] * stride_x + kbs[None, :] * stride_b
    return e8m0_to_float(tl.load(ptrs, mask=mask[:, None] & (kbs < num_kb)[None, :], other=127))


@triton.jit
def _half(v, bit: tl.constexpr):
    """Columns of ``v [X, C]`` whose index has the low bit ``bit``: ``[X, C / 2]`` (``[X]`` when C is 2)."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1] // 2, 2)))
    return odd if bit else even


@triton.jit
def scale_column(s, j: tl.constexpr, NB: tl.constexpr):
    """Column ``j`` of a ``[X, NB]`` scale tile (NB = 1, 2, 4 or 8), by splits: no arithmetic, no reduction."""
    tl.static_assert(NB == 1 or NB == 2 or NB == 4 or NB == 8, "BLOCK_K / 32 must be 1, 2, 4 or 8")
    v = s
    if NB >= 2:
        v = _half(v, j % 2)
    if NB >= 4:
        v = _half(v, (j // 2) % 2)
    if NB >= 8:
        v = _half(v, (j // 4) % 2)
    return tl.reshape(v, (s.shape[0],))


@triton.jit
def abs_bits(v):
    """int32 bits of ``|v|`` for float32 ``v``: ordered like the magnitudes, NaN and inf on top."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def quantize_along_cols(v, BLOCKS: tl.constexpr):
    """MX blocks along each row of float32 ``v [BR, BLOCKS * 32]``: (E4M3 bytes ``[BR, BLOCKS * 32]``,
    E8M0 codes ``[BR, BLOCKS]``), both int32. Padding lanes must hold zeros (a zero leaves the amax)."""
    bits = v.to(tl.int32, bitcast=True).reshape(v.shape[0], BLOCKS, 32)
    codes = e8m0_codes(tl.max(bits & 0x7FFFFFFF, axis=2))
    elements = e4m3_codes(bits, block_exponent(codes)[:, :, None])
    return elements.reshape(v.shape[0], BLOCKS * 32), codes


@triton.jit
def quantize_along_rows(v):
    """One MX block down each column of float32 ``v [32, BX]``: (E4M3 bytes ``[32, BX]``, E8M0 codes ``[BX]``)."""
    bits = v.to(tl.int32, bitcast=True)
    codes = e8m0_codes(tl.max(bits & 0x7FFFFFFF, axis=0))
    return e4m3_codes(bits, block_exponent(codes)[None, :]), codes


@triton.jit
def swizzle(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    """``(m tile, n tile)`` of a persistent loop's ``tile_id``: GROUP_M row tiles share each column sweep
    (L2 reuse of B), as in the bf16 grouped GEMM; a copy so the MX kernels do not import its privates."""
    width = GROUP_M * num_n
    group = tile_id // width
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % width) % size, (tile_id % width) // size
