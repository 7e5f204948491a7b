"""The FP8 quantiser kernels against :mod:`megamoe.quant.fp8`, byte for byte.

Runs under ``TRITON_INTERPRET=1`` on the CPU (the conftest sets it) and on a GPU alike: the kernels
round in integer arithmetic and divide with IEEE division, so the interpreter runs what the GPU does.
Ragged widths (not multiples of 128), segments that end inside a tile, empty segments, NaN, infinity,
subnormals, zero tiles.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton_fp8.quantize import (
    empty_weight,
    gather_rows,
    packed_row_bytes,
    quantize_rows,
    quantize_rows_packed,
    quantize_segments,
    quantize_weight,
    quantize_weight_both,
    rows_for_tma,
    segment_block_starts,
    unpack_rows,
)
from megamoe.quant.fp8 import quantize_fp8, quantize_fp8_blocks
from tests.megamoe.triton_mx.test_quantize import DEVICE, spread


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize(("rows", "cols"), [(5, 128), (9, 200), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_quantize_fp8_bitwise(rows: int, cols: int, dtype: torch.dtype) -> None:
    src = spread(rows, cols, seed=rows, dtype=dtype).to(DEVICE)
    src[1] = 0.0  # a zero tile: scale 1
    got, want = quantize_rows(src), quantize_fp8(src, dim=1)
    assert got.tile == want.tile == (1, 128)
    torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(_bytes(got.data), _bytes(want.data))


def test_rows_nan_poisons_only_its_tile_and_valid_rows_limit_the_work() -> None:
    src = torch.ones(4, 256, device=DEVICE)
    src[0, 3] = float("nan")
    src[1, 200] = float("inf")
    got = quantize_rows(src, valid_rows_1=torch.tensor([3], dtype=torch.int32, device=DEVICE))
    want = quantize_fp8(src[:3], dim=1)
    assert torch.isnan(got.scale[0, 0]) and got.scale[0, 1] == want.scale[0, 1]
    assert torch.isnan(got.scale[1, 1]) and got.scale[1, 0] == want.scale[1, 0]
    torch.testing.assert_close(got.scale[:3], want.scale, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cols", [16, 144, 272])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_hold_the_rowwise_bits_in_at_most_the_rows_width(cols: int, dtype: torch.dtype) -> None:
    """The rows that move between ranks: each row's E4M3 bytes then its scales, no wider than the
    unquantised row, read back (as views, gathered, or laid out for TMA) with :func:`quantize_rows`'s bits."""
    src = spread(7, cols, seed=cols, dtype=dtype).to(DEVICE)
    src[2] = 0.0
    packed = quantize_rows_packed(src)
    nbytes = packed_row_bytes(cols)
    assert nbytes % 16 == 0 and nbytes >= cols + 4 * -(-cols // 128)
    assert packed.dtype == dtype and packed.shape == (7, nbytes // src.element_size())
    assert packed.shape[1] <= cols
    want = quantize_fp8(src, dim=1)
    index = torch.tensor([6, 0, 0, 3], dtype=torch.int32, device=DEVICE)
    for got, rows in (
        (unpack_rows(packed, cols), slice(None)),
        (rows_for_tma(unpack_rows(packed, cols)), slice(None)),
        (gather_rows(unpack_rows(packed, cols), index), index.long()),
    ):
        torch.testing.assert_close(got.scale, want.scale[rows], rtol=0, atol=0)
        assert torch.equal(_bytes(got.data), _bytes(want.data[rows]))
    tma = rows_for_tma(unpack_rows(packed, cols))
    assert tma.data.is_contiguous() and tma.scale.t().is_contiguous()  # what the GEMMs read by TMA
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_rows(packed[:, :-1], cols)


@pytest.mark.parametrize("tile", [None, (32, 4), (64, 8)])  # the default; columns past X in a program
def test_segments_match_quantize_fp8_per_segment_bitwise(tile: tuple[int, int] | None) -> None:
    counts = [130, 0, 5, 128, 1]  # a tile and a bit, empty, short, exact, one row
    R, X = sum(counts), 40
    src = spread(R + 7, X, seed=3).to(DEVICE)
    index = torch.randperm(R + 7, generator=torch.Generator().manual_seed(0))[:R].to(DEVICE)
    row_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    block_start = segment_block_starts(row_start)
    assert block_start.tolist() == [0, 2, 2, 3, 4, 5]
    num_blocks = -(-R // 128) + len(counts)
    got = quantize_segments(src, row_start, block_start, num_blocks, index_R=index, tile=tile)
    rows = src[index]
    for g, (lo, hi) in enumerate(zip(row_start[:-1].tolist(), row_start[1:].tolist(), strict=True)):
        if lo == hi:
            continue
        want = quantize_fp8(rows[lo:hi], dim=0)  # [n, X] in 128-row tiles
        b0, b1 = block_start[g].item(), block_start[g + 1].item()
        data = _bytes(got.data[:, 128 * b0 : 128 * b1])
        assert torch.equal(data[:, : hi - lo], _bytes(want.data).t()), f"segment {g}"
        assert (data[:, hi - lo :] == 0).all(), f"segment {g}: padding lanes must be zero"
        assert torch.equal(got.scale[:, b0:b1], want.scale.t()), f"segment {g}"


@pytest.mark.parametrize("transposed", [False, True])
def test_weight_blocks_match_quantize_fp8_blocks_bitwise(transposed: bool) -> None:
    w = torch.cat([spread(144, 272, seed=s) for s in range(2)]).view(2, 144, 272).to(DEVICE)
    w[1, :128, :128] = 0.0  # a zero block: scale 1
    source = w.transpose(1, 2) if transposed else w
    out = empty_weight(tuple(source.shape), torch.device(DEVICE))
    quantize_weight(source, out)
    want = quantize_fp8_blocks(source)
    torch.testing.assert_close(out.scale, want.scale, rtol=0, atol=0)
    assert torch.equal(_bytes(out.data), _bytes(want.data))


def test_weight_both_forms_in_one_pass_match_quantize_fp8_blocks_bitwise() -> None:
    w = torch.cat([spread(144, 272, seed=s) for s in range(2)]).view(2, 144, 272).to(DEVICE)
    w[1, :128, 128:256] = 0.0  # a zero block: scale 1
    w[0, 130, 5] = float("nan")  # poisons its block in both forms
    out, out_t = (
        empty_weight((2, 144, 272), torch.device(DEVICE)),
        empty_weight((2, 272, 144), torch.device(DEVICE)),
    )
    quantize_weight_both(w, out, out_t)
    for got, source in ((out, w), (out_t, w.transpose(1, 2))):
        want = quantize_fp8_blocks(source)
        torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(_bytes(got.data), _bytes(want.data))
    assert out_t.data.is_contiguous() and out_t.scale.is_contiguous()


def test_weight_both_forms_reject_a_wrong_transposed_buffer() -> None:
    w = torch.zeros(1, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected contiguous FP8 buffers \[1, 32, 16\]"):
        quantize_weight_both(w, empty_weight((1, 16, 32), w.device), empty_weight((1, 16, 32), w.device))
