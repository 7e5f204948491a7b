"""The OCP MX number format used by the MXFP8 expert path: E4M3 elements, one E8M0 scale per 32.

A tensor is cut into blocks of :data:`BLOCK` consecutive elements along one dimension (the GEMM's
reduction dimension). Each block shares one power-of-two scale ``2**e`` stored as an E8M0 code
``e + 127`` (:data:`E8M0_NAN` = 255 is NaN); each element is stored as ``round(v / 2**e)`` in E4M3
(``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, finite max 448, no infinities).

Rules, each pinned by a test in ``tests/megamoe/quant/test_mx_format.py``:

* Input is first rounded to float32 (bf16 and float32 convert exactly; float64 rounds once).
* Scale from the block amax: ``e`` is the smallest integer with ``amax <= 448 * 2**e``. That equals
  OCP's ``floor(log2(amax)) - 8`` except when amax's mantissa exceeds 1.75, where OCP's choice would
  clip the block's largest element to 448 (up to 12.5 % error) and ours takes the next exponent
  instead (the rule NVIDIA's MXFP8 recipes use). ``e`` is clamped to E8M0's ``[-127, 127]``.
* An all-zero block gets scale 1 (code 127); its elements are 0.
* Elements round to nearest, ties to even, and saturate: anything beyond ±448 after scaling becomes
  ±448, never NaN. With the scale rule above only the E8M0 clamp can make that happen.
* A block holding a NaN or an infinity gets the NaN scale, so all 32 of its values dequantise to NaN:
  a non-finite value poisons its block loudly rather than turning into a finite number.
* A dimension that is not a multiple of 32 ends in a short block, as if zero-padded (zeros change
  neither the amax nor a dot product).

Quantise and dequantise are exact power-of-two scalings, so ``dequantize(quantize(v))`` is
``2**e * e4m3(v / 2**e)`` with no other rounding, on CPU and GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
"""elements per scale block (OCP MX)."""
E4M3_MAX = 448.0
"""largest finite E4M3 magnitude."""
E8M0_BIAS = 127
E8M0_NAN = 255
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


@dataclass(slots=True)
class MXTensor:
    """A tensor in MX form: E4M3 ``data`` in the source's shape, E8M0 ``scale`` codes per block.

    ``scale`` has the source's shape with dimension ``dim`` shrunk to ``ceil(n / 32)``.
    """

    data: Tensor
    """``torch.float8_e4m3fn``, the source's shape."""
    scale: Tensor
    """``torch.uint8`` E8M0 codes (``e + 127``; 255 = NaN)."""
    dim: int
    """the blocked dimension (non-negative)."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The represented values (exact in float32), converted to ``dtype``."""
        scale = e8m0_to_float(self.scale).repeat_interleave(BLOCK, dim=self.dim)
        scale = scale.narrow(self.dim, 0, self.data.shape[self.dim])
        return (self.data.to(torch.float32) * scale).to(dtype)


def _pow2(exponent: Tensor) -> Tensor:
    """``2.0**exponent`` in float32, exactly, for integer exponents in ``[-127, 127]`` (built from bits)."""
    exponent = exponent.to(torch.int32)
    normal = ((exponent + E8M0_BIAS).clamp(min=1) << 23).view(torch.float32)
    subnormal = torch.full_like(normal, 2.0**-127)
    return torch.where(exponent >= -126, normal, subnormal)


def e8m0_to_float(codes: Tensor) -> Tensor:
    """E8M0 codes (uint8) to their float32 values ``2**(code - 127)``; code 255 is NaN."""
    values = _pow2(codes.to(torch.int32) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, float("nan")), values)


def block_scale_codes(amax: Tensor) -> Tensor:
    """E8M0 code of each block from its float32 ``amax`` (see the module rules); uint8, same shape."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # amax <= 448 * 2**e  with 448 = 0.875 * 2**9  <=>  e >= exponent - 9 (+1 if mantissa > 0.875)
    e = exponent - 9 + (mantissa > E4M3_MAX / 512).to(torch.int32)
    codes = e.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP) + E8M0_BIAS
    codes = torch.where(amax == 0, torch.full_like(codes, E8M0_BIAS), codes)
    codes = torch.where(torch.isfinite(amax), codes, torch.full_like(codes, E8M0_NAN))
    return codes.to(torch.uint8)


def quantize_e4m3(values: Tensor) -> Tensor:
    """Float values to E4M3, round to nearest even, saturating at ±448 (NaN stays NaN)."""
    return values.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _blocked(values: Tensor, dim: int) -> tuple[Tensor, int]:
    """``values`` as float32 with ``dim`` moved last and cut into ``[..., nblocks, 32]`` (zero-padded)."""
    moved = values.to(torch.float32).movedim(dim, -1)
    n = moved.shape[-1]
    pad = -n % BLOCK
    if pad:
        moved = F.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], (n + pad) // BLOCK, BLOCK), n


def _quantize_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """E4M3 elements ``[..., nblocks, 32]`` and E8M0 codes ``[..., nblocks]`` of float32 blocks."""
    codes = block_scale_codes(blocks.abs().amax(-1))
    exponent = torch.where(codes != E8M0_NAN, codes.to(torch.int32) - E8M0_BIAS, 0)
    return quantize_e4m3(blocks * _pow2(-exponent).unsqueeze(-1)), codes


def _unblocked(blocks: Tensor, n: int, dim: int) -> Tensor:
    """Inverse of :func:`_blocked`'s layout: ``[..., nblocks, 32]`` back to the source shape."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)[..., :n].movedim(-1, dim)


def quantize_mx(values: Tensor, dim: int = -1, *, out: MXTensor | None = None) -> MXTensor:
    """Quantise ``values`` to MX with blocks of 32 along ``dim``.

    With ``out``, the result is written into its buffers (same shape and dim) and ``out`` is returned:
    the weight cache rewrites its tensors in place instead of allocating new ones each step.
    """
    if values.dim() == 0:
        raise ValueError("values: expected a tensor with at least one dimension, got a scalar")
    dim = dim % values.dim()
    blocks, n = _blocked(values, dim)
    elements, codes = _quantize_blocks(blocks)
    data, scale = _unblocked(elements, n, dim), codes.movedim(-1, dim)
    if out is None:
        return MXTensor(data=data.contiguous(), scale=scale.contiguous(), dim=dim)
    if out.dim != dim or out.data.shape != data.shape or out.scale.shape != scale.shape:
        raise ValueError(
            f"out: expected MX buffers of shape {tuple(data.shape)} blocked along dim {dim}, "
            f"got {tuple(out.data.shape)} along dim {out.dim}"
        )
    out.data.copy_(data)
    out.scale.copy_(scale)
    return out


def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``mx`` represents, in ``dtype`` (exact in float32)."""
    return mx.dequantize(dtype)


def fake_quantize_mx(values: Tensor, dim: int = -1) -> Tensor:
    """``quantize_mx`` then dequantise, in float32: the operand an MXFP8 GEMM actually multiplies.

    Same values as ``quantize_mx(values, dim).dequantize()``, computed in the blocked layout.
    """
    if values.dim() == 0:
        raise ValueError("values: expected a tensor with at least one dimension, got a scalar")
    dim = dim % values.dim()
    blocks, n = _blocked(values, dim)
    elements, codes = _quantize_blocks(blocks)
    return _unblocked(elements.to(torch.float32) * e8m0_to_float(codes).unsqueeze(-1), n, dim)


def empty_mx(shape: tuple[int, ...], dim: int, device: torch.device) -> MXTensor:
    """Uninitialised MX buffers for a tensor of ``shape`` blocked along ``dim``."""
    dim = dim % len(shape)
    scale_shape = list(shape)
    scale_shape[dim] = -(-shape[dim] // BLOCK)
    return MXTensor(
        data=torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(scale_shape, dtype=torch.uint8, device=device),
        dim=dim,
    )
