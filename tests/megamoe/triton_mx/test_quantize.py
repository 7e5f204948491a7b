"""The MX quantiser kernels against :func:`megamoe.quant.mx.quantize_mx`, byte for byte.

Runs under ``TRITON_INTERPRET=1`` on the CPU (the conftest sets it) and on a GPU alike: the kernels
round in integer arithmetic, so the interpreter runs the same instructions the GPU does.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton_mx.quantize_rows import empty_rows_mx, quantize_rows
from megamoe.backends.triton_mx.quantize_segments import (
    quantize_segments,
    quantize_transposed_weight,
    segment_block_starts,
)
from megamoe.quant.mx import MXTensor, quantize_mx

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def spread(rows: int, cols: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian values times 2**U(-20, 20) per element, with exact zeros, ties and the format's edges."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-20, 21, (rows, cols), generator=g).float()
    )
    flat = v.view(-1)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            448.0,
            -448.0,
            449.0,
            464.0,
            480.0,
            1.75,
            1.76,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-10,
            1.0625,
            1.1875,
            3e38,
            -3e38,
            1e-40,
            -1e-42,
            2.0**-126,
            2.0**-149,
        ]
    )
    flat[: edges.numel()] = edges[: flat.numel()]
    v[rows // 3] = 0.0  # whole zero blocks
    if cols > 40:
        v[rows // 2, 32:40] *= 2.0**-30  # tiny values in a block led by large ones: E4M3 subnormals
    return v.to(dtype)


def assert_same_mx(got: MXTensor, want: MXTensor) -> None:
    got_scale, want_scale = got.scale.cpu(), want.scale.cpu()
    bad = (got_scale != want_scale).nonzero()
    assert bad.numel() == 0, (
        f"scale {tuple(bad[0].tolist())}: {got_scale[tuple(bad[0])]} vs {want_scale[tuple(bad[0])]}"
    )
    got_data, want_data = got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu()
    bad = (got_data != want_data).nonzero()
    assert bad.numel() == 0, (
        f"data {tuple(bad[0].tolist())}: {got_data[tuple(bad[0])]:#x} vs {want_data[tuple(bad[0])]:#x}"
    )


@pytest.mark.parametrize(
    ("rows", "cols", "dtype"),
    [(37, 96, torch.float32), (16, 200, torch.float32), (5, 31, torch.float32), (33, 64, torch.bfloat16)],
    ids=["multi-block", "short-last-block", "one-short-block", "bf16"],
)
def test_quantize_rows_bitwise_equals_quantize_mx(rows: int, cols: int, dtype: torch.dtype) -> None:
    src = spread(rows, cols, dtype=dtype)
    got = quantize_rows(src.to(DEVICE))
    assert_same_mx(got, quantize_mx(src, dim=1))


def test_quantize_rows_nan_and_inf_poison_their_block_only() -> None:
    src = spread(6, 96, seed=1)
    src[0, 3] = float("nan")
    src[1, 40] = float("inf")
    src[2, 70] = -float("inf")
    src[3, 0] = -float("nan")
    got = quantize_rows(src.to(DEVICE))
    want = quantize_mx(src, dim=1)
    assert got.scale[0, 0] == 255 and got.scale[1, 1] == 255 and got.scale[0, 1] != 255
    assert_same_mx(got, want)


def test_quantize_rows_every_e4m3_value_and_midpoint() -> None:
    """Each representable magnitude and each midpoint between neighbours, inside blocks scaled by 1."""
    codes = torch.arange(0, 127, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    body = torch.cat([values, mids, -values, -mids])
    body = torch.cat([body, torch.zeros(-body.numel() % 31)]).reshape(-1, 31)
    src = torch.cat([torch.full((body.shape[0], 1), 448.0), body], dim=1)  # amax 448: scale code 127
    got = quantize_rows(src.to(DEVICE))
    assert (got.scale.cpu() == 127).all()
    assert_same_mx(got, quantize_mx(src, dim=1))


def test_quantize_rows_writes_strided_scales_and_stops_at_valid_rows() -> None:
    src = spread(20, 64, seed=2)
    out = empty_rows_mx(20, 64, DEVICE, blocks_major=True)
    out.data.view(torch.uint8).fill_(0xAB)
    out.scale.fill_(0xCD)
    valid = torch.tensor([13], dtype=torch.int32, device=DEVICE)
    quantize_rows(src.to(DEVICE), out, valid_rows_1=valid)
    want = quantize_mx(src[:13], dim=1)
    assert_same_mx(MXTensor(out.data[:13], out.scale[:13], 1), want)
    assert (out.data.view(torch.uint8)[13:] == 0xAB).all() and (out.scale[13:] == 0xCD).all()


def _segments(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    num_blocks = -(-sum(counts) // 32) + len(counts)
    return starts, segment_block_starts(starts), num_blocks


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_quantize_segments_blocks_start_at_each_segment_and_match_quantize_mx(gather: bool) -> None:
    counts = [0, 45, 32, 1, 0, 70]
    R, X = sum(counts), 40
    src = spread(R + 7, X, seed=3)
    index = torch.randperm(R + 7, generator=torch.Generator().manual_seed(0))[:R].to(torch.int32)
    rows = src[index.long()] if gather else src[:R]
    starts, block_start, num_blocks = _segments(counts)
    got = quantize_segments(
        (src if gather else src[:R]).to(DEVICE),
        starts,
        block_start,
        num_blocks,
        index_R=index.to(DEVICE) if gather else None,
    )
    data, scale = got.data.view(torch.uint8).cpu(), got.scale.cpu()
    assert block_start.tolist() == [0, 0, 2, 3, 4, 4, 7]
    for g, chunk in enumerate(rows.split(counts)):
        if not counts[g]:
            continue
        b0, nb = block_start[g].item(), -(-counts[g] // 32)
        want = quantize_mx(chunk, dim=0)
        lanes = data[:, 32 * b0 : 32 * (b0 + nb)]
        assert torch.equal(lanes[:, : counts[g]], want.data.view(torch.uint8).t()), f"expert {g}"
        assert (lanes[:, counts[g] :] == 0).all(), f"expert {g}: zero lanes past the segment"
        assert torch.equal(scale[:, b0 : b0 + nb], want.scale.t()), f"expert {g} scales"


@pytest.mark.parametrize("Y", [50, 64], ids=["short-last-block", "whole-blocks"])
def test_quantize_transposed_weight_equals_quantize_mx_of_the_transpose(Y: int) -> None:
    """Y = 64: whole blocks, stores without a lane mask (the path the real weights take)."""
    w = spread(3 * Y, 24, seed=4).reshape(3, Y, 24)
    out = MXTensor(
        data=torch.empty(3, 24, Y, dtype=torch.float8_e4m3fn, device=DEVICE),
        scale=torch.empty(-(-Y // 32), 3, 24, dtype=torch.uint8, device=DEVICE).permute(1, 2, 0),
        dim=2,
    )
    quantize_transposed_weight(w.to(DEVICE), out)
    assert_same_mx(out, quantize_mx(w.transpose(1, 2), dim=-1))
