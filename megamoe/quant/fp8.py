"""Blockwise FP8 (DeepSeek-V3's recipe) for the ``fp8`` expert path: E4M3 elements, one float32 scale per tile.

Activations and gradients are cut into 1×128 tiles along one dimension (the GEMM's reduction
dimension, or the token dimension for the weight-gradient operands): :func:`quantize_fp8`. Weights
``[..., Y, X]`` are cut into 128×128 blocks over their last two dimensions: :func:`quantize_fp8_blocks`.
Each tile has one scale ``s``; each element is stored as ``e4m3(v / s)`` (``torch.float8_e4m3fn``).

Rules, each pinned by a test in ``tests/megamoe/quant/test_fp8_format.py``:

* Input is first rounded to float32 (bf16 and float32 convert exactly; float64 rounds once).
* Scale ``s = amax / 448`` in float32 (IEEE division, round to nearest even), so the tile's largest
  magnitude lands on 448, E4M3's largest finite value. ``s`` is at least ``2**-126`` (float32's
  smallest normal): a tile with ``amax < 448 * 2**-126`` gets that floor, so ``s`` is never zero or
  subnormal and ``v / s`` is always finite.
* An all-zero tile gets scale 1; its elements are 0.
* ``scale_format="ue8m0"``: power-of-two scales instead, ``s = 2**ceil(log2(amax / 448))`` evaluated
  exactly (the smallest integer ``e`` with ``amax <= 448 * 2**e``, clamped to E8M0's ``[-127, 127]``):
  the MX scale rule (:func:`~megamoe.quant.mx.block_scale_codes`) on 128-element tiles. The largest
  element then lands in ``(224, 448]``, up to one bit of range lost, and a kernel can apply the scale
  by adding exponents. Zero and non-finite tiles follow the same rules as fp32 scales.
* Elements ``e4m3(v / s)``: float32 division, then round to nearest, ties to even, saturating at ±448
  (the division can land a hair above 448 when ``s`` was rounded down): never NaN from finite input.
* A tile holding a NaN or an infinity gets a NaN scale, so all its values dequantise to NaN: a
  non-finite value poisons its tile loudly rather than turning into a finite number (as in
  :mod:`megamoe.quant.mx`).
* A dimension that is not a multiple of 128 ends in a short tile, as if zero-padded (zeros change
  neither the amax nor a dot product).

The represented value is ``e4m3 * s``: 4 significant bits times 24, exact in float64.
:meth:`FP8Tensor.dequantize` rounds it once to the requested dtype (float32: a relative error below
``2**-24``, far under E4M3's ``2**-4``; one float32 multiply is that rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from megamoe.errors import InvalidConfigError
from megamoe.quant.mx import E4M3_MAX, block_scale_codes, e8m0_to_float, quantize_e4m3

TILE = 128
"""elements per scale along a tiled dimension (1×128 tiles, 128×128 weight blocks)."""
MIN_SCALE = 2.0**-126
"""the smallest fp32 scale: float32's smallest normal."""
SCALE_FORMATS = ("fp32", "ue8m0")
ScaleFormat = Literal["fp32", "ue8m0"]


@dataclass(slots=True)
class FP8Tensor:
    """A tensor in blockwise FP8: E4M3 ``data`` in the source's shape, one float32 ``scale`` per tile.

    ``tile[d]`` is the tiles' extent along dimension ``d`` (1 or :data:`TILE`): ``(1, 128)`` for rows
    tiled along dim 1, ``(128, 1)`` along dim 0, ``(1, 128, 128)`` for ``[G, Y, X]`` weight blocks.
    ``scale`` has ``ceil(shape[d] / tile[d])`` entries along each dimension.
    """

    data: Tensor
    """``torch.float8_e4m3fn``, the source's shape."""
    scale: Tensor
    """``torch.float32``, one per tile (NaN for a tile that held a NaN or an infinity)."""
    tile: tuple[int, ...]
    """the tile shape, one extent per dimension."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def narrow(self, dim: int, start: int, length: int) -> FP8Tensor:
        """The elements ``[start, start + length)`` along ``dim`` with their tiles' scales, as views (no
        copy); ``start`` must begin a tile."""
        extent = self.tile[dim]
        if start % extent:
            raise ValueError(f"start {start} along dim {dim} is inside a tile of {extent}")
        stop = min(-(-(start + length) // extent), self.scale.shape[dim])
        scale = self.scale.narrow(dim, start // extent, stop - start // extent)
        return FP8Tensor(self.data.narrow(dim, start, length), scale, self.tile)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The represented values ``e4m3 * s`` (exact in float64), rounded once to ``dtype``."""
        scale = self.scale
        for dim, extent in enumerate(self.tile):
            if extent > 1:
                scale = scale.repeat_interleave(extent, dim=dim).narrow(dim, 0, self.data.shape[dim])
        return _represented(self.data, scale, dtype)


def _represented(elements: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``elements * scale`` rounded once to ``dtype``: a float32 product is already the correctly rounded
    value; any other dtype goes through the exact float64 product (rounding float32 again would be a
    second rounding)."""
    exact = torch.float32 if dtype == torch.float32 else torch.float64
    return (elements.to(exact) * scale.to(exact)).to(dtype)


def tile_scales(amax: Tensor, *, scale_format: ScaleFormat = "fp32") -> Tensor:
    """Each tile's float32 scale from its float32 ``amax`` (see the module rules); same shape."""
    _check_scale_format(scale_format)
    if scale_format == "ue8m0":
        return e8m0_to_float(block_scale_codes(amax))
    # a tensor divisor, not a Python scalar: CUDA turns division by a scalar into a reciprocal multiply
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise InvalidConfigError(
            "scale_format", scale_format, "unknown FP8 scale format", f"Use one of {', '.join(SCALE_FORMATS)}"
        )


def _row_tile(ndim: int, dim: int) -> tuple[int, ...]:
    """1×128 tiles along ``dim`` of an ``ndim``-dimensional tensor."""
    return tuple(TILE if d == dim else 1 for d in range(ndim))


def _block_tile(ndim: int) -> tuple[int, ...]:
    """128×128 blocks over the last two dimensions of an ``ndim``-dimensional tensor."""
    return (1,) * (ndim - 2) + (TILE, TILE)


def _tiled(values: Tensor, tile: tuple[int, ...]) -> Tensor:
    """``values`` in float32, zero-padded to whole tiles, viewed as ``[n0, t0, n1, t1, ...]``."""
    moved = values.to(torch.float32)
    pad = [
        p
        for size, extent in zip(reversed(moved.shape), reversed(tile), strict=True)
        for p in (0, -size % extent)
    ]
    if any(pad):
        moved = F.pad(moved, pad)
    return moved.reshape(
        [n for size, extent in zip(moved.shape, tile, strict=True) for n in (size // extent, extent)]
    )


def _untiled(tiled: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of :func:`_tiled`'s layout: back to ``shape``, the padding cut off."""
    padded = [tiled.shape[2 * d] * tiled.shape[2 * d + 1] for d in range(len(shape))]
    return tiled.reshape(padded)[tuple(slice(0, size) for size in shape)]


def _quantize_tiled(tiled: Tensor, scale_format: ScaleFormat) -> tuple[Tensor, Tensor]:
    """E4M3 elements (tiled layout) and float32 scales ``[n0, 1, n1, 1, ...]`` of float32 tiles."""
    amax = tiled.abs().amax(dim=tuple(range(1, tiled.dim(), 2)), keepdim=True)
    scale = tile_scales(amax, scale_format=scale_format)
    return quantize_e4m3(tiled / scale), scale


def _quantize(
    values: Tensor, tile: tuple[int, ...], scale_format: ScaleFormat, out: FP8Tensor | None
) -> FP8Tensor:
    elements, scale = _quantize_tiled(_tiled(values, tile), scale_format)
    data = _untiled(elements, values.shape)
    scale = scale.reshape(scale.shape[0::2])
    if out is None:
        return FP8Tensor(data=data.contiguous(), scale=scale.contiguous(), tile=tile)
    if out.tile != tile or out.data.shape != data.shape or out.scale.shape != scale.shape:
        raise InvalidConfigError(
            "out",
            f"{tuple(out.data.shape)} in tiles {out.tile}",
            f"expected FP8 buffers of shape {tuple(data.shape)} in tiles {tile}",
        )
    out.data.copy_(data)
    out.scale.copy_(scale)
    return out


def _fake(values: Tensor, tile: tuple[int, ...], scale_format: ScaleFormat, dtype: torch.dtype) -> Tensor:
    elements, scale = _quantize_tiled(_tiled(values, tile), scale_format)
    return _untiled(_represented(elements, scale, dtype), values.shape)


def _dim(values: Tensor, dim: int) -> int:
    if values.dim() == 0:
        raise InvalidConfigError("values", "a scalar", "expected a tensor with at least one dimension")
    return dim % values.dim()


def _check_blocks(values: Tensor) -> None:
    if values.dim() < 2:
        raise InvalidConfigError(
            "values.shape", tuple(values.shape), "128×128 blocks need at least two dimensions [..., Y, X]"
        )


def quantize_fp8(
    values: Tensor, dim: int = -1, *, scale_format: ScaleFormat = "fp32", out: FP8Tensor | None = None
) -> FP8Tensor:
    """Quantise ``values`` in 1×128 tiles along ``dim`` (activations and gradients).

    With ``out``, the result is written into its buffers (same shape and tiles) and ``out`` is returned.
    """
    return _quantize(values, _row_tile(values.dim(), _dim(values, dim)), scale_format, out)


def quantize_fp8_blocks(
    values: Tensor, *, scale_format: ScaleFormat = "fp32", out: FP8Tensor | None = None
) -> FP8Tensor:
    """Quantise ``values [..., Y, X]`` in 128×128 blocks over its last two dimensions (weights).

    The blocks of the transpose are the transposes of the blocks, so this one quantisation of ``W``
    also gives ``W^T`` exactly. With ``out``, the result is written into its buffers.
    """
    _check_blocks(values)
    return _quantize(values, _block_tile(values.dim()), scale_format, out)


def fake_quantize_fp8(
    values: Tensor, dim: int = -1, *, scale_format: ScaleFormat = "fp32", dtype: torch.dtype = torch.float32
) -> Tensor:
    """``quantize_fp8(values, dim)`` then dequantise to ``dtype``: the operand an FP8 GEMM multiplies."""
    return _fake(values, _row_tile(values.dim(), _dim(values, dim)), scale_format, dtype)


def fake_quantize_fp8_blocks(
    values: Tensor, *, scale_format: ScaleFormat = "fp32", dtype: torch.dtype = torch.float32
) -> Tensor:
    """``quantize_fp8_blocks(values)`` then dequantise to ``dtype``."""
    _check_blocks(values)
    return _fake(values, _block_tile(values.dim()), scale_format, dtype)


def empty_fp8_blocks(shape: tuple[int, ...], device: torch.device) -> FP8Tensor:
    """Uninitialised FP8 buffers for a tensor of ``shape`` in 128×128 blocks over its last two dims."""
    tile = _block_tile(len(shape))
    return FP8Tensor(
        data=torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(
            [-(-size // extent) for size, extent in zip(shape, tile, strict=True)],
            dtype=torch.float32,
            device=device,
        ),
        tile=tile,
    )
