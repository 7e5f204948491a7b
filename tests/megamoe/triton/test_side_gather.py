"""RowGather: the backward's transient row gathers, run beside the dgrad GEMM on a side stream."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton import side_gather, tma_rows
from megamoe.backends.triton.side_gather import RowGather


def _problem(device: str, rows: int = 1001, hidden: int = 72):
    """A ragged last row block (1001 rows) and, at hidden 1100, a ragged second column chunk."""
    g = torch.Generator(device="cpu").manual_seed(0)
    src = torch.randn(300, hidden, generator=g).to(device)
    index = torch.randint(0, 300, (rows,), generator=g).to(device=device, dtype=torch.int32)
    return src, index


@pytest.mark.parametrize(("rows", "hidden"), [(1001, 72), (37, 1100), (0, 72)])
def test_rows_are_the_gather_on_cpu(rows: int, hidden: int) -> None:
    """The Triton kernel (interpreted) against torch's gather."""
    src, index = _problem("cpu", rows, hidden)
    gather = RowGather(src, index)
    gather.start()
    assert torch.equal(gather.rows(), src[index.long()])


def test_a_column_slice_is_gathered_in_place() -> None:
    """A column slice of a wider tensor (dW1's chunks of ``x``) is read through its row stride, no copy."""
    src, index = _problem("cpu", 101, 72)
    piece = src[:, 16:48]
    gather = RowGather(piece, index)
    gather.start()
    assert torch.equal(gather.rows(), src[index.long(), 16:48])


def test_the_tma_gather_is_for_cuda_rows_only() -> None:
    """Off CUDA (and so in the interpreter) the register kernel above runs: TMA needs a Hopper GPU."""
    src = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not tma_rows.supported(src, torch.zeros(8, 64, dtype=torch.bfloat16))


def test_rows_before_start_is_an_error() -> None:
    src, index = _problem("cpu")
    with pytest.raises(RuntimeError, match="before start"):
        RowGather(src, index).rows()


@pytest.mark.gpu
def test_side_stream_gather_is_ordered_against_a_busy_stream(monkeypatch) -> None:
    """The source is written on the current stream just before the fork and the rows are overwritten
    just after the join: a gather that ran early (before the write) or late (after the overwrite)
    would differ from ``src[index]``. ``torch.cuda._sleep`` keeps the current stream busy meanwhile,
    as the dgrad GEMM does."""
    monkeypatch.setattr(side_gather, "SIDE_STREAM_MIN_BYTES", 0)  # this small gather on the side stream too
    src, index = _problem("cuda")
    fresh = torch.empty_like(src)
    torch.cuda._sleep(50_000_000)  # ~25 ms: the write below is still queued when the gather is enqueued
    fresh.copy_(src)
    gather = RowGather(fresh, index)
    torch.cuda._sleep(50_000_000)  # the "GEMM" the gather runs beside
    gather.start()
    rows = gather.rows()
    snapshot = rows.clone()  # on the current stream: after the join
    rows.zero_()
    assert torch.equal(snapshot, src[index.long()])


@pytest.mark.gpu
@pytest.mark.parametrize("side_min_bytes", [0, side_gather.SIDE_STREAM_MIN_BYTES], ids=["side", "inline"])
def test_side_stream_gather_captures_in_a_cuda_graph(monkeypatch, side_min_bytes: int) -> None:
    monkeypatch.setattr(side_gather, "SIDE_STREAM_MIN_BYTES", side_min_bytes)
    src, index = _problem("cuda")
    static_src = src.clone()
    out = torch.empty(index.numel(), src.shape[1], device="cuda")

    def step() -> None:
        gather = RowGather(static_src, index)
        torch.cuda._sleep(1_000_000)
        gather.start()
        out.copy_(gather.rows() * 2)

    step()  # warm-up outside the capture (creates the side stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static_src.copy_(src + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (src + 1)[index.long()] * 2)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "hidden"), [(1001, 72), (37, 7168), (4099, 2048), (513, 1100)])
def test_bf16_rows_go_by_tma_on_hopper_and_equal_the_gather(rows: int, hidden: int) -> None:
    """The side stream's persistent gather: bf16 rows a multiple of 16 bytes go through the TMA kernel on
    Hopper (a ragged last row block, a row narrower than one 256-column box, DeepSeek-V3's width); 1100
    columns (2200 bytes) through the register kernel. Either way the rows are ``src[index]``."""
    src, index = _problem("cuda", rows, hidden)
    src = src.to(torch.bfloat16)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert tma_rows.supported(src, out) == (hopper and hidden % 8 == 0)
    side_gather.gather_rows(src, index, out)
    assert torch.equal(out, src[index.long()])


@pytest.mark.gpu
def test_a_column_slice_goes_by_tma_on_hopper_and_equals_the_gather() -> None:
    """dW1's chunks: 1024 columns from 256 on of 4096-column rows (TMA on Hopper), and 520 of 1100-column
    rows, whose 2200-byte row stride TMA cannot take (the register kernel)."""
    for hidden, start, width, by_tma in ((4096, 256, 1024, True), (1100, 8, 520, False)):
        src, index = _problem("cuda", 777, hidden)
        piece = src.to(torch.bfloat16)[:, start : start + width]
        out = torch.empty(777, width, dtype=torch.bfloat16, device="cuda")
        assert tma_rows.supported(piece, out) == (by_tma and torch.cuda.get_device_capability()[0] >= 9)
        side_gather.gather_rows(piece, index, out)
        assert torch.equal(out, piece[index.long()])


@pytest.mark.gpu
def test_small_gathers_run_inline_as_one_launch() -> None:
    """Below ``SIDE_STREAM_MIN_BYTES`` a CUDA gather is one ``index_select`` on the current stream: no
    side stream, no counter to zero."""
    from torch.profiler import ProfilerActivity, profile

    src, index = _problem("cuda")
    gather = RowGather(src.to(torch.bfloat16), index)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gather.start()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    assert torch.equal(gather.rows(), src.to(torch.bfloat16)[index.long()])
