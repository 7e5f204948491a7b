"""Blockwise FP8 against hand-computed vectors: tile scales, E4M3 rounding in a tile, tiles and blocks."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.errors import InvalidConfigError
from megamoe.quant import (
    FP8Tensor,
    fake_quantize_fp8,
    fake_quantize_fp8_blocks,
    fake_quantize_mx,
    quantize_e4m3,
    quantize_fp8,
    quantize_fp8_blocks,
    tile_scales,
)
from megamoe.quant.fp8 import TILE, empty_fp8_blocks

NAN = float("nan")
INF = float("inf")
FLOAT32_MAX = torch.finfo(torch.float32).max
# 1/448 = 2^-9 * 8/7, 8/7 = 1.001001001...b: 23 bits 00100100100100100100100, then 1001...: rounds up
ONE_OVER_448 = 0b1_00100100100100100100101 * 2.0**-32
# 19/448 = 2^-5 * 19/14, 19/14 = 1.0101101101101101101101|1011...b: the cut-off bits 011... round down
NINETEEN_OVER_448 = 0b1_01011011011011011011011 * 2.0**-28


def _tile(*head: float) -> torch.Tensor:
    """One full tile of 128: ``head`` then zeros."""
    return torch.tensor([*head] + [0.0] * (TILE - len(head)))


def _same(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


# (tile amax, float32 scale) worked by hand: s = RN_float32(amax / 448), at least 2^-126.
SCALE_CASES = {
    "896 -> 2": (896.0, 2.0),
    "448 -> 1": (448.0, 1.0),
    "7 -> 2^-6 exactly": (7.0, 2.0**-6),
    "1 -> 1/448 rounded up": (1.0, ONE_OVER_448),
    "19 -> 19/448 rounded down": (19.0, NINETEEN_OVER_448),
    "448 * 2^-126 -> 2^-126, the floor's edge": (448 * 2.0**-126, 2.0**-126),
    "2^-130 -> floor 2^-126": (2.0**-130, 2.0**-126),
    "float32 subnormal 1e-40 -> floor 2^-126": (1e-40, 2.0**-126),
    "zero tile -> 1": (0.0, 1.0),
    "NaN -> NaN": (NAN, NAN),
    "inf -> NaN": (INF, NAN),
}


@pytest.mark.parametrize("amax, scale", SCALE_CASES.values(), ids=SCALE_CASES.keys())
def test_tile_scales_fp32_hand_computed(amax, scale):
    _same(tile_scales(torch.tensor([amax])), torch.tensor([scale]))


# (tile amax, power-of-two scale): the smallest 2^e with amax <= 448 * 2^e, e in [-127, 127].
UE8M0_CASES = {
    "896 = 448 * 2 -> 2": (896.0, 2.0),
    "900 -> 4": (900.0, 4.0),
    "448 -> 1": (448.0, 1.0),
    "449 -> 2": (449.0, 2.0),
    "100 <= 448/4 = 112 -> 1/4": (100.0, 0.25),
    "1 <= 448/256 = 1.75 -> 2^-8": (1.0, 2.0**-8),
    "2^-140 clamps to 2^-127": (2.0**-140, 2.0**-127),
    "zero tile -> 1": (0.0, 1.0),
    "NaN -> NaN": (NAN, NAN),
    "inf -> NaN": (INF, NAN),
}


@pytest.mark.parametrize("amax, scale", UE8M0_CASES.values(), ids=UE8M0_CASES.keys())
def test_tile_scales_ue8m0_hand_computed(amax, scale):
    _same(tile_scales(torch.tensor([amax]), scale_format="ue8m0"), torch.tensor([scale]))


def test_tile_scales_fp32_is_ieee_division_of_the_amax_by_448():
    """Correctly rounded: a float32 quotient computed in float64 and rounded once is the IEEE result."""
    amax = torch.rand(4000, generator=torch.Generator().manual_seed(0)).mul(100).sub(50).exp2()
    expected = (amax.double() / 448).float()
    _same(tile_scales(amax), expected)


# (tile head, scale, stored E4M3 values, dequantised values), worked by hand
TILE_CASES = {
    "amax 896: scale 2, 34/2=17 and 38/2=19 are ties (to even 16 and 20)": (
        [896.0, -896.0, 448.0, 1.0, 0.5, 34.0, 38.0],
        2.0,
        [448.0, -448.0, 224.0, 0.5, 0.25, 16.0, 20.0],
        [896.0, -896.0, 448.0, 1.0, 0.5, 32.0, 40.0],
    ),
    "amax 7: scale 2^-6, 3.3*64 = 211.2 -> 208 (spacing 16), 2^-20*64 = 2^-14 underflows to 0": (
        [7.0, -3.5, 3.3, 2.0**-20],
        2.0**-6,
        [448.0, -224.0, 208.0, 0.0],
        [7.0, -3.5, 3.25, 0.0],
    ),
    "amax 19: s rounded down, 19/s = 448.00003 saturates to 448": (
        [19.0, -19.0, 9.5],
        NINETEEN_OVER_448,
        [448.0, -448.0, 224.0],
        [448 * NINETEEN_OVER_448, -448 * NINETEEN_OVER_448, 224 * NINETEEN_OVER_448],
    ),
    "float32 max = (2^24-1) 2^104: s = (2^24-1)/7 * 2^98 exactly; -1e38/s = -131.7 -> -128": (
        [FLOAT32_MAX, -1e38],
        2396745 * 2.0**98,
        [448.0, -128.0],
        [FLOAT32_MAX, -128 * 2396745 * 2.0**98],
    ),
    "zero tile: scale 1": ([0.0, -0.0], 1.0, [0.0, -0.0], [0.0, -0.0]),
}


@pytest.mark.parametrize("head, scale, data, values", TILE_CASES.values(), ids=TILE_CASES.keys())
def test_quantize_fp8_one_tile_hand_computed(head, scale, data, values):
    q = quantize_fp8(_tile(*head).unsqueeze(0))
    assert q.tile == (1, TILE) and q.scale.shape == (1, 1) and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.item() == scale
    got = q.data.float()[0, : len(data)].tolist()
    assert got == data and [math.copysign(1, g) for g in got] == [math.copysign(1, d) for d in data]
    deq = q.dequantize(torch.float64)[0]
    assert deq[: len(values)].tolist() == values and not deq[len(head) :].any()


def test_quantize_fp8_short_final_tile_acts_as_zero_padded():
    """130 along the tiled dim: a full tile (amax 896, scale 2) and a tile of 2 (amax 7, scale 2^-6)."""
    row = torch.cat([_tile(896.0, 3.0), torch.tensor([7.0, -3.5])]).unsqueeze(0)
    q = quantize_fp8(row)
    assert q.data.shape == (1, 130) and q.scale.tolist() == [[2.0, 2.0**-6]]
    assert q.data.float()[0, [0, 1, 128, 129]].tolist() == [448.0, 1.5, 448.0, -224.0]
    padded = torch.cat([row, torch.zeros(1, 126)], 1)
    _same(q.dequantize(), quantize_fp8(padded).dequantize()[:, :130])


def test_quantize_fp8_along_dim0_tiles_the_columns():
    """Tiles along dim 0 (the wgrad operands' R): one scale per column per 128 rows."""
    values = torch.zeros(130, 2)
    values[3, 0], values[129, 0], values[60, 1] = 896.0, 7.0, 448.0
    q = quantize_fp8(values, dim=0)
    assert q.tile == (TILE, 1) and q.scale.tolist() == [[2.0, 1.0], [2.0**-6, 1.0]]
    _same(q.dequantize(), values)


def test_quantize_fp8_blocks_one_scale_per_128x128_block_of_the_last_two_dims():
    """w [2, 130, 200]: blocks rows 0..127 | 128..129 by columns 0..127 | 128..199, per expert.

    Row 5 holds 896 in block (0, 0) and 3.5 in block (0, 1), whose amax is the -7 in row 100: a 1×128
    rowwise tiling would give row 5's second tile scale 3.5/448 instead of 7/448.
    """
    w = torch.zeros(2, 130, 200)
    w[0, 5, 7], w[0, 5, 130], w[0, 100, 150], w[0, 129, 0] = 896.0, 3.5, -7.0, 448.0
    w[1, 128, 199] = 19.0
    q = quantize_fp8_blocks(w)
    assert q.tile == (1, TILE, TILE) and q.scale.shape == (2, 2, 2)
    assert q.scale.tolist() == [[[2.0, 2.0**-6], [1.0, 1.0]], [[1.0, 1.0], [1.0, NINETEEN_OVER_448]]]
    spikes = q.data.float()[[0, 0, 0, 0, 1], [5, 5, 100, 129, 128], [7, 130, 150, 0, 199]]
    assert spikes.tolist() == [448.0, 224.0, -448.0, 448.0, 448.0]
    _same(q.dequantize()[0], w[0])


def test_quantize_fp8_ue8m0_scales_hand_computed():
    """amax 100 -> scale 1/4. 400, 200 and 100 are all ties (384|416, 192|208, 96|104): to even 384, 192,
    96; -52 is exact."""
    q = quantize_fp8(_tile(100.0, 50.0, 25.0, -13.0).unsqueeze(0), scale_format="ue8m0")
    assert q.scale.item() == 0.25
    assert q.data.float()[0, :4].tolist() == [384.0, 192.0, 96.0, -52.0]
    assert q.dequantize()[0, :4].tolist() == [96.0, 48.0, 24.0, -13.0]


def test_quantize_fp8_ue8m0_equals_mx_on_rows_of_one_mx_block():
    """Power-of-two scales are MX's scale rule: a row of 32 (one short fp8 tile) quantises alike."""
    values = (
        torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * torch.logspace(-30, 30, 64)[:, None]
    )
    _same(fake_quantize_fp8(values, scale_format="ue8m0"), fake_quantize_mx(values))


@pytest.mark.parametrize("special", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_quantize_fp8_non_finite_value_poisons_only_its_tile(special):
    values = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    values[1, 130] = special
    q = quantize_fp8(values)
    assert torch.isnan(q.scale[1, 1]) and torch.isfinite(q.scale).sum() == 5
    deq = q.dequantize()
    assert deq[1, 128:].isnan().all() and torch.isfinite(deq[1, :128]).all()
    assert torch.isfinite(deq[[0, 2]]).all()


def test_quantize_fp8_blocks_non_finite_value_poisons_only_its_block():
    w = torch.randn(1, 256, 256, generator=torch.Generator().manual_seed(3))
    w[0, 200, 10] = NAN
    deq = quantize_fp8_blocks(w).dequantize()[0]
    assert deq[128:, :128].isnan().all()
    assert torch.isfinite(deq[:128]).all() and torch.isfinite(deq[128:, 128:]).all()


# ---------------------------------------------------------------- properties


def _naive_fake_quantize_rows(values: torch.Tensor) -> torch.Tensor:
    """Tile by tile along the last dim of a 2-D tensor, from the rules: s = RN(amax / 448) (float64
    quotient rounded once), elements RN(v / s) in float32, then E4M3."""
    out = torch.empty(values.shape, dtype=torch.float64)
    for r in range(values.shape[0]):
        for start in range(0, values.shape[1], TILE):
            tile = values[r, start : start + TILE].float()
            amax = tile.abs().max().double()
            s = 1.0 if amax == 0 else max(float((amax / 448).float()), 2.0**-126)
            elements = quantize_e4m3((tile.double() / s).float())
            out[r, start : start + TILE] = elements.double() * s
    return out


def _wide(shape, seed: int) -> torch.Tensor:
    """Gaussian values times 2^i per index of dim 0, i in [-20, 20]: tiles with very different scales."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randint(-20, 21, (shape[0],) + (1,) * (len(shape) - 1), generator=g).float().exp2()
    return torch.randn(shape, generator=g) * spread


def test_fake_quantize_fp8_matches_a_naive_per_tile_loop():
    values = _wide((6, 300), 4)
    values[2] = 0.0
    _same(fake_quantize_fp8(values, dtype=torch.float64), _naive_fake_quantize_rows(values))


@pytest.mark.parametrize(
    ("shape", "dim"), [((5, 300), -1), ((5, 300), 0), ((257, 7), 0), ((2, 3, 130), 1), ((4, 128), 1)]
)
def test_fake_quantize_fp8_equals_quantize_then_dequantize(shape, dim):
    values = _wide(shape, 5)
    for dtype in (torch.float32, torch.float64):
        _same(fake_quantize_fp8(values, dim, dtype=dtype), quantize_fp8(values, dim).dequantize(dtype))


@pytest.mark.parametrize("shape", [(2, 130, 300), (1, 128, 128), (3, 5, 7), (200, 140)])
def test_fake_quantize_fp8_blocks_equals_quantize_then_dequantize(shape):
    values = _wide(shape, 6)
    _same(fake_quantize_fp8_blocks(values), quantize_fp8_blocks(values).dequantize())


def test_quantize_fp8_blocks_of_the_transpose_are_the_transposed_blocks():
    """Why one weight quantisation serves forward (W) and dgrad (W^T): same bytes, same scales."""
    w = _wide((3, 200, 300), 7)
    q, qt = quantize_fp8_blocks(w), quantize_fp8_blocks(w.transpose(1, 2))
    assert torch.equal(q.data.transpose(1, 2).view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(q.scale.transpose(1, 2), qt.scale)


def test_quantize_fp8_along_dim0_equals_rowwise_of_transpose():
    values = _wide((300, 5), 8)
    _same(fake_quantize_fp8(values, 0), fake_quantize_fp8(values.t().contiguous(), 1).t())


def test_quantize_fp8_rowwise_commutes_with_a_row_gather():
    """Why a kernel may quantise tokens at the source and send E4M3 rows with their scales."""
    values = _wide((16, 200), 9)
    rows = torch.tensor([3, 3, 0, 15, 7, 7, 1])
    _same(fake_quantize_fp8(values)[rows], fake_quantize_fp8(values[rows]))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_quantize_fp8_error_is_within_half_an_e4m3_step(scale_format):
    """|deq - v| <= 2^-4 |v| (normals, plus float32's rounding of v / s) or half a subnormal step s 2^-10."""
    values = _wide((8, 512), 10)
    q = quantize_fp8(values, scale_format=scale_format)
    s = q.scale.repeat_interleave(TILE, dim=1)
    err = (q.dequantize(torch.float64) - values.double()).abs()
    assert (err <= 2.0**-4 * (1 + 2.0**-20) * values.double().abs() + 2.0**-10 * s.double()).all()


@pytest.mark.parametrize(("scale_format", "low"), [("fp32", 448.0), ("ue8m0", 224.0)])
def test_quantize_fp8_largest_element_of_each_tile_lands_at_448(scale_format, low):
    """fp32 scales map every tile's amax onto 448 exactly; power-of-two scales into (224, 448], which
    E4M3 rounds into [224, 448]: up to one bit of the tile's range unused."""
    q = quantize_fp8(_wide((8, 640), 11), scale_format=scale_format)
    top = q.data.float().abs().reshape(8, 5, TILE).amax(-1)
    assert ((top >= low) & (top <= 448)).all()


def test_quantize_fp8_bf16_input_equals_float32_input():
    values = _wide((4, 256), 12).bfloat16()
    _same(fake_quantize_fp8(values), fake_quantize_fp8(values.float()))


def test_dequantize_is_exact_in_float64_and_rounded_once_in_float32():
    q = quantize_fp8(_tile(19.0, 9.5, -1.0).unsqueeze(0))
    exact = q.data.double() * q.scale.double()
    _same(q.dequantize(torch.float64), exact)
    _same(q.dequantize(), exact.float())


def test_quantize_fp8_writes_into_out_in_place():
    values = _wide((2, 4, 300), 13)
    out = empty_fp8_blocks(tuple(values.shape), torch.device("cpu"))
    ptrs = (out.data.data_ptr(), out.scale.data_ptr())
    assert quantize_fp8_blocks(values, out=out) is out
    assert (out.data.data_ptr(), out.scale.data_ptr()) == ptrs
    _same(out.dequantize(), fake_quantize_fp8_blocks(values))


def test_quantize_fp8_out_of_the_wrong_shape_names_the_buffers():
    out = empty_fp8_blocks((2, 4, 300), torch.device("cpu"))
    with pytest.raises(InvalidConfigError, match=r"^out=.*expected FP8 buffers of shape \(2, 4, 200\)"):
        quantize_fp8_blocks(torch.zeros(2, 4, 200), out=out)
    with pytest.raises(InvalidConfigError, match=r"in tiles \(1, 1, 128\)"):
        quantize_fp8(torch.zeros(2, 4, 300), out=out)


def test_quantize_fp8_empty_tensors():
    q = quantize_fp8(torch.zeros(0, 300))
    assert q.data.shape == (0, 300) and q.scale.shape == (0, 3)
    assert quantize_fp8_blocks(torch.zeros(2, 0, 5)).dequantize().shape == (2, 0, 5)


def test_quantize_fp8_rejects_bad_arguments():
    with pytest.raises(
        InvalidConfigError, match=r"^scale_format='e8m0': unknown FP8 scale format\. Use one of fp32, ue8m0"
    ):
        quantize_fp8(torch.zeros(4), scale_format="e8m0")
    with pytest.raises(InvalidConfigError, match=r"^values='a scalar'"):
        quantize_fp8(torch.tensor(1.0))
    with pytest.raises(InvalidConfigError, match=r"^values.shape=\(4,\): 128×128 blocks need"):
        quantize_fp8_blocks(torch.zeros(4))


def test_fp8_tensor_reports_its_bytes():
    q = quantize_fp8_blocks(torch.zeros(2, 256, 130))
    assert isinstance(q, FP8Tensor) and q.shape == (2, 256, 130)
    assert q.nbytes == 2 * 256 * 130 + 2 * 2 * 2 * 4
