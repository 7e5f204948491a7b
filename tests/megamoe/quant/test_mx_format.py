"""The MX format against hand-computed vectors: scale from the block amax, E4M3 rounding, specials."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megamoe.quant import (
    BLOCK,
    E4M3_MAX,
    MXTensor,
    block_scale_codes,
    e8m0_to_float,
    fake_quantize_mx,
    quantize_e4m3,
    quantize_mx,
)
from megamoe.quant.mx import empty_mx

NAN = float("nan")
INF = float("inf")


def _block(first: float, rest: float = 0.0) -> torch.Tensor:
    """One block of 32: ``first`` then 31 copies of ``rest``."""
    return torch.tensor([first] + [rest] * (BLOCK - 1))


def _e4m3_values() -> list[float]:
    """Every finite non-negative E4M3 (fn) value, in code order, written from the format definition."""
    values = [m / 8 * 2.0**-6 for m in range(8)]  # exponent field 0: subnormals m/8 * 2^-6
    for exp_field in range(1, 16):
        for m in range(8):
            if exp_field == 15 and m == 7:  # 0x7F is NaN
                continue
            values.append((1 + m / 8) * 2.0 ** (exp_field - 7))
    return values


def _rne_e4m3(v: float) -> float:
    """Round-to-nearest-even onto E4M3 with saturation, by search over the value table (slow, obvious)."""
    if math.isnan(v):
        return NAN
    table = _e4m3_values()
    mag = min(abs(v), E4M3_MAX)
    best = min(range(len(table)), key=lambda i: (abs(table[i] - mag), i % 2))  # ties: even code
    return math.copysign(table[best], v)


# (block amax, E8M0 code) worked by hand: e is the smallest integer with amax <= 448 * 2**e.
SCALE_CASES = {
    "448 fits 2^0": (448.0, 127),
    "449 needs 2^1": (449.0, 128),
    "1.0 -> 2^-8 (1*256 = 256 <= 448)": (1.0, 119),
    "1.75 -> 2^-8 exactly (1.75*256 = 448)": (1.75, 119),
    "1.76 -> 2^-7 (OCP's floor rule would clip it)": (1.76, 120),
    "2^-6 -> 2^-14": (2.0**-6, 113),
    "3e38 -> 2^120": (3e38, 247),
    "2^-130 clamps to 2^-127": (2.0**-130, 0),
    "float32 subnormal 1e-44 clamps": (1e-44, 0),
    "zero block -> scale 1": (0.0, 127),
    "NaN -> NaN scale": (NAN, 255),
    "inf -> NaN scale": (INF, 255),
}


@pytest.mark.parametrize("amax, code", SCALE_CASES.values(), ids=SCALE_CASES.keys())
def test_block_scale_codes_hand_computed(amax, code):
    assert block_scale_codes(torch.tensor([amax])).item() == code


@pytest.mark.parametrize("seed", range(3))
def test_block_scale_codes_equal_ocp_floor_rule_unless_amax_mantissa_exceeds_1_75(seed):
    amax = torch.rand(2000, generator=torch.Generator().manual_seed(seed)).mul(60).sub(30).exp2()
    codes = block_scale_codes(amax).int()
    for a, c in zip(amax.tolist(), codes.tolist(), strict=True):
        mantissa, exponent = math.frexp(a)  # a = mantissa * 2**exponent, mantissa in [0.5, 1)
        ocp = exponent - 1 - 8 + 127  # floor(log2 a) - emax(E4M3) + bias
        assert c == (ocp + 1 if 2 * mantissa > 1.75 else ocp), a


E4M3_CASES = {
    "zero": (0.0, 0.0),
    "negative zero": (-0.0, -0.0),
    "min subnormal 2^-9 exact": (2.0**-9, 2.0**-9),
    "half min subnormal ties to 0": (2.0**-10, 0.0),
    "just above half min subnormal": (2.0**-10 * 1.01, 2.0**-9),
    "3*2^-10 ties to even 2^-8": (3 * 2.0**-10, 2.0**-8),
    "largest subnormal 7*2^-9": (7 * 2.0**-9, 7 * 2.0**-9),
    "min normal 2^-6": (2.0**-6, 2.0**-6),
    "1.0625 ties to even 1.0": (1.0625, 1.0),
    "1.1875 ties to even 1.25": (1.1875, 1.25),
    "1.07 rounds up to 1.125": (1.07, 1.125),
    "-3.3 -> -3.25": (-3.3, -3.25),
    "448 max": (448.0, 448.0),
    "416 exact": (416.0, 416.0),
    "432, midway 416|448, ties to even 448": (432.0, 448.0),
    "449 saturates": (449.0, 448.0),
    "1e6 saturates": (1e6, 448.0),
    "-1e6 saturates": (-1e6, -448.0),
    "inf saturates": (INF, 448.0),
    "-inf saturates": (-INF, -448.0),
}


@pytest.mark.parametrize("value, expected", E4M3_CASES.values(), ids=E4M3_CASES.keys())
def test_quantize_e4m3_hand_computed(value, expected):
    got = quantize_e4m3(torch.tensor([value])).float().item()
    assert got == expected and math.copysign(1, got) == math.copysign(1, expected)


def test_quantize_e4m3_nan_stays_nan():
    assert math.isnan(quantize_e4m3(torch.tensor([NAN])).float().item())


def test_quantize_e4m3_matches_table_search_on_every_value_and_midpoint():
    table = _e4m3_values()
    probes = set(table)
    for lo, hi in itertools.pairwise(table):
        mid = (lo + hi) / 2
        probes |= {mid, math.nextafter(mid, 0), math.nextafter(mid, INF)}
    probes |= {460.0, 479.0, 480.0, 1e30}
    values = sorted(probes) + [-p for p in sorted(probes)]
    got = quantize_e4m3(torch.tensor(values, dtype=torch.float64)).float().tolist()
    expected = [_rne_e4m3(float(torch.tensor(v, dtype=torch.float32))) for v in values]
    bad = [(v, g, e) for v, g, e in zip(values, got, expected, strict=True) if g != e]
    assert not bad, f"first mismatches (value, got, expected): {bad[:5]}"


def test_e8m0_to_float_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(codes).tolist()
    assert got[:255] == [2.0 ** (c - 127) for c in range(255)]
    assert math.isnan(got[255])


def test_quantize_mx_zero_block_has_scale_one_and_zero_data():
    mx = quantize_mx(torch.zeros(2, BLOCK))
    assert mx.scale.tolist() == [[127], [127]]
    assert mx.dequantize().eq(0).all()


def test_quantize_mx_scale_from_block_amax_and_elements_scaled():
    # amax 3.0 = 0.75 * 2^2 -> e = 2 - 9 = -7, so elements are stored as v * 128.
    values = _block(3.0, -0.3)
    mx = quantize_mx(values.unsqueeze(0))
    assert mx.scale.item() == 127 - 7
    assert mx.data.float()[0, 0].item() == 384.0
    assert mx.data.float()[0, 1].item() == -40.0  # -0.3 * 128 = -38.4 -> nearest E4M3 is -40
    assert mx.dequantize()[0, 1].item() == -40.0 / 128


def test_quantize_mx_subnormal_elements_in_a_block():
    # amax 448 -> scale 1; 3 * 2^-9 is an E4M3 subnormal, 2^-10 ties to 0.
    values = torch.tensor([[448.0, 3 * 2.0**-9, 2.0**-10, -(2.0**-9)] + [0.0] * 28])
    got = quantize_mx(values).dequantize()[0, :4].tolist()
    assert got == [448.0, 3 * 2.0**-9, 0.0, -(2.0**-9)]


@pytest.mark.parametrize("special", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_quantize_mx_non_finite_poisons_only_its_block(special):
    values = torch.ones(1, 3 * BLOCK)
    values[0, BLOCK + 5] = special
    mx = quantize_mx(values)
    assert mx.scale.tolist() == [[127 - 8, 255, 127 - 8]]
    out = mx.dequantize()
    assert out[0, BLOCK : 2 * BLOCK].isnan().all()
    assert out[0, :BLOCK].eq(1).all() and out[0, 2 * BLOCK :].eq(1).all()


def test_quantize_mx_short_tail_block_equals_zero_padding():
    values = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([values, torch.zeros(3, 24)], 1)
    short, full = quantize_mx(values), quantize_mx(padded)
    assert short.scale.shape == (3, 2)
    torch.testing.assert_close(short.scale, full.scale, rtol=0, atol=0)
    torch.testing.assert_close(short.dequantize(), full.dequantize()[:, :40], rtol=0, atol=0)


def test_quantize_mx_along_dim0_equals_rowwise_of_transpose():
    values = torch.randn(70, 5, generator=torch.Generator().manual_seed(1))
    cols, rows = quantize_mx(values, dim=0), quantize_mx(values.t(), dim=1)
    assert cols.scale.shape == (3, 5)
    torch.testing.assert_close(cols.dequantize(), rows.dequantize().t(), rtol=0, atol=0)


def test_quantize_mx_represented_values_round_trip_exactly():
    g = torch.Generator().manual_seed(2)
    values = torch.randn(4, 64, generator=g)
    once = fake_quantize_mx(values)
    torch.testing.assert_close(fake_quantize_mx(once), once, rtol=0, atol=0)


def test_quantize_mx_error_within_half_an_e4m3_step():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g).mul(20).exp2()
    mx = quantize_mx(values)
    scale = e8m0_to_float(mx.scale).repeat_interleave(BLOCK, 1)
    # half a step of E4M3 is 2^-4 relative for normals, 2^-10 absolute (times the scale) for subnormals
    bound = torch.maximum(values.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((mx.dequantize() - values).abs() <= bound).all()


def test_quantize_mx_bf16_input_equals_float32_input():
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    a, b = quantize_mx(values), quantize_mx(values.float())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("shape, dim", [((0, 64), 1), ((4, 0), 0), ((0, 5), 0)])
def test_quantize_mx_empty_tensors(shape, dim):
    mx = quantize_mx(torch.zeros(shape), dim=dim)
    assert mx.data.shape == shape and mx.dequantize().shape == shape


def test_quantize_mx_out_rewrites_buffers_in_place():
    out = empty_mx((2, 3, 64), dim=-1, device=torch.device("cpu"))
    ptrs = (out.data.data_ptr(), out.scale.data_ptr())
    values = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    got = quantize_mx(values, out=out)
    assert got is out and (out.data.data_ptr(), out.scale.data_ptr()) == ptrs
    torch.testing.assert_close(out.dequantize(), fake_quantize_mx(values), rtol=0, atol=0)


def test_quantize_mx_out_with_wrong_shape_raises():
    out = empty_mx((2, 64), dim=-1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"expected MX buffers of shape \(2, 96\)"):
        quantize_mx(torch.zeros(2, 96), out=out)


def test_mx_tensor_nbytes_counts_data_and_scales():
    mx = quantize_mx(torch.ones(4, 64))
    assert isinstance(mx, MXTensor) and mx.nbytes == 4 * 64 + 4 * 2


@pytest.mark.parametrize("shape, dim", [((5, 70), 1), ((70, 5), 0), ((2, 3, 64), 1)])
def test_fake_quantize_mx_equals_quantize_then_dequantize(shape, dim):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(6)) * 1e3
    values.view(-1)[7] = NAN
    got, expected = fake_quantize_mx(values, dim), quantize_mx(values, dim).dequantize()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fn", [quantize_mx, fake_quantize_mx], ids=["quantize_mx", "fake_quantize_mx"])
def test_quantize_mx_scalar_raises(fn):
    with pytest.raises(ValueError, match="at least one dimension"):
        fn(torch.tensor(1.0))
