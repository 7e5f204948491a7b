"""Blockwise FP8 quantisers: rows in 1×128 tiles, rows along R per expert (the wgrad operands), and
weights in 128×128 blocks.

Legend: R rows, X columns, G segments (experts) ``[row_start[g], row_start[g+1])``, NB 128-row block
slots along R, KB = ceil(X / 128).

* :func:`quantize_rows` — ``[R, X]`` → E4M3 ``[R, X]`` + scales ``[R, KB]`` (stored ``[KB, R]``: a GEMM
  tile reads one K tile's scales of its rows as one line). The producer of every rowwise GEMM operand
  not fused elsewhere: ``x`` and ``dy`` at the source (rowwise tiles commute with the row gather),
  ``dh`` for the fc1 dgrad.
* :func:`quantize_rows_packed` — the same tiles with each row's scales after its E4M3 bytes, in one
  row no wider than the source's (:func:`unpack_rows` reads it): ``x``'s rows as they move over the
  symmetric-memory workspace.
* :func:`quantize_segments` — the packed wgrad operand: E4M3 ``[X, 128 NB]`` (R contiguous, what
  Hopper's FP8 MMA wants for a reduction over R) + scales ``[X, NB]``; segment g from column
  ``128 block_start[g]``, its last tile zero-padded. ``index`` fuses the dispatch gather.
* :func:`quantize_weight` — ``w [G, Y, X]`` (or its transposed view) in 128×128 blocks, into a
  contiguous ``[G, Y, X]`` form + scales ``[G, ceil(Y / 128), ceil(X / 128)]``;
  :func:`quantize_weight_both` writes the forms of ``w`` and ``w^T`` in one pass over ``w``.

Each is bit-identical to :mod:`megamoe.quant.fp8` (``quantize_fp8(src, dim=1)``,
``quantize_fp8(src[segment], dim=0)`` per segment, ``quantize_fp8_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.rows_quant import check_rows, quantize_rows_into
from megamoe.backends.triton.segments import block_starts, quantize_segments_kernel
from megamoe.backends.triton_fp8.fp8_math import (
    TILE,
    quantize_along_cols,
    quantize_along_rows,
    quantize_block,
)
from megamoe.quant.fp8 import FP8Tensor

SEGMENT_TILE = (32, 4)
"""(columns, warps) of a :func:`quantize_segments` program on a GPU: a [128, 32] fp32 tile, no spills
(``python -m benchmarks.sweep_fp8_gemm --passes-only`` times the others)"""


def empty_rows(rows: int, cols: int, device: torch.device) -> FP8Tensor:
    """Uninitialised ``[rows, cols]`` FP8 buffers in 1×128 tiles along each row, scales stored ``[KB, rows]``."""
    tiles = -(-cols // TILE)
    return FP8Tensor(
        data=torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(tiles, rows, dtype=torch.float32, device=device).t(),
        tile=(1, TILE),
    )


def gather_rows(a: FP8Tensor, index_R: Tensor) -> FP8Tensor:
    """``a[index_R]``: rows of ``[T, X]`` FP8 in 1×128 tiles (scales stored ``[KB, T]``) gathered into
    ``[R, X]`` (scales ``[KB, R]``), ``index_R`` int32 in ``[0, T)``. Rowwise tiles move with their rows,
    so this is the quantised gather of the rows: one byte an element, a copy at memory speed."""
    R, X = index_R.shape[0], a.data.shape[1]
    out = empty_rows(R, X, a.data.device)
    if R and X:
        torch.index_select(a.data.view(torch.uint8), 0, index_R, out=out.data.view(torch.uint8))
        torch.index_select(a.scale.t(), 1, index_R, out=out.scale.t())
    return out


def row_block(cols: int, device: torch.device) -> tuple[int, int]:
    """``(rows, 128-column tiles)`` one program of a rowwise pass over ``cols`` columns handles."""
    if device.type != "cuda":
        return 8, 1
    tiles = min(next_power_of_2(-(-cols // TILE)), 2)
    return max(1, 4096 // (tiles * TILE)), tiles


def quantize_rows(src_RX: Tensor, *, valid_rows_1: Tensor | None = None) -> FP8Tensor:
    """``src_RX`` in 1×128 tiles along each row; ``valid_rows_1`` (a one-element device tensor) limits
    the work to the first rows (the rest is left unwritten). Any float dtype, unit column stride."""
    check_rows(src_RX)
    out = empty_rows(*src_RX.shape, src_RX.device)
    _quantize_rows_into(src_RX, out, valid_rows_1)
    return out


def _quantize_rows_into(src_RX: Tensor, out: FP8Tensor, valid_rows_1: Tensor | None) -> None:
    block_r, tiles = row_block(src_RX.shape[1], src_RX.device)
    quantize_rows_into(
        src_RX,
        out.data,
        out.scale,
        valid_rows_1,
        block_r=block_r,
        block_x=tiles * TILE,
        tile=TILE,
        quantize_along_cols=quantize_along_cols,
    )


def packed_row_bytes(cols: int) -> int:
    """Bytes of one row with its scales beside it (:func:`quantize_rows_packed`): ``cols`` E4M3 bytes,
    then ``ceil(cols / 128)`` float32 scales, rounded up to 16 bytes."""
    return -(-(cols + 4 * -(-cols // TILE)) // 16) * 16


def quantize_rows_packed(src_RX: Tensor) -> Tensor:
    """``src_RX``'s rows in 1×128 tiles, each row's E4M3 bytes followed by its scales, in one ``[R, W]``
    tensor of ``src_RX``'s dtype (``W`` elements hold :func:`packed_row_bytes` bytes; at most ``X``):
    rows that move between ranks as one row each, in about half of bf16's bytes, through buffers made
    for the unquantised rows. :func:`unpack_rows` reads them; the bits are :func:`quantize_rows`'s."""
    check_rows(src_RX)
    R, X = src_RX.shape
    packed = torch.empty(
        R, packed_row_bytes(X) // src_RX.element_size(), dtype=src_RX.dtype, device=src_RX.device
    )
    _quantize_rows_into(src_RX, unpack_rows(packed, X), None)
    return packed


def unpack_rows(packed_RW: Tensor, cols: int) -> FP8Tensor:
    """The :class:`FP8Tensor` of :func:`quantize_rows_packed`'s rows (``packed_RW``: any rows of them, row
    stride ``W``), as views: ``data [R, cols]`` and ``scales [R, KB]``, both at the packed row stride."""
    raw = packed_RW.view(torch.uint8)
    if raw.shape[1] < packed_row_bytes(cols) or raw.stride(1) != 1:
        raise ValueError(
            f"packed rows of {raw.shape[1]} bytes cannot hold {cols} FP8 columns and their scales"
        )
    tiles = -(-cols // TILE)
    return FP8Tensor(
        data=raw[:, :cols].view(torch.float8_e4m3fn),
        scale=raw[:, cols : cols + 4 * tiles].view(torch.float32),
        tile=(1, TILE),
    )


def rows_for_tma(a: FP8Tensor) -> FP8Tensor:
    """``a``'s rows in the layout the GEMMs read by TMA (:func:`empty_rows`: data contiguous, scales
    stored ``[KB, R]``): a copy at memory speed, one byte an element; ``a`` itself when it has it."""
    R, X = a.data.shape
    if a.data.is_contiguous() and a.scale.stride() == (1, max(R, 1)):
        return a
    out = empty_rows(R, X, a.data.device)
    out.data.copy_(a.data)
    out.scale.copy_(a.scale)
    return out


def segment_block_starts(row_start_G1: Tensor) -> Tensor:
    """``block_start [G + 1]`` (int32, on the device, one launch, no sync): exclusive prefix sum of
    ``ceil(rows / 128)``. A static bound on the slots: ``ceil(R / 128) + G``."""
    return block_starts(row_start_G1, block=TILE)


def empty_segments(cols: int, num_blocks: int, device: torch.device) -> FP8Tensor:
    """Uninitialised packed along-R operand: E4M3 ``[cols, 128 num_blocks]``, scales ``[cols, num_blocks]``
    stored ``[num_blocks, cols]``."""
    return FP8Tensor(
        data=torch.empty(cols, num_blocks * TILE, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(num_blocks, cols, dtype=torch.float32, device=device).t(),
        tile=(1, TILE),
    )


def segments_bytes(cols: int, num_blocks: int) -> int:
    """Bytes an :func:`empty_segments` operand takes in a buffer (:func:`segments_in`), rounded up to 16."""
    scale_at = -(-cols * num_blocks * TILE // 16) * 16
    return -(-(scale_at + 4 * cols * num_blocks) // 16) * 16


def segments_in(buffer: Tensor, cols: int, num_blocks: int) -> FP8Tensor | None:
    """An :func:`empty_segments` operand laid out in ``buffer``'s bytes (contiguous, no longer read), or
    None when it does not fit: E4M3 data from its start, the scales from the next 16-byte boundary."""
    data_bytes = cols * num_blocks * TILE
    scale_at = -(-data_bytes // 16) * 16
    if (
        not buffer.is_contiguous()
        or scale_at + 4 * cols * num_blocks > buffer.numel() * buffer.element_size()
    ):
        return None
    raw = buffer.view(-1).view(torch.uint8)
    scales = raw[scale_at : scale_at + 4 * cols * num_blocks].view(torch.float32)
    return FP8Tensor(
        data=raw[:data_bytes].view(torch.float8_e4m3fn).view(cols, num_blocks * TILE),
        scale=scales.view(num_blocks, cols).t(),
        tile=(1, TILE),
    )


def quantize_segments(
    src_RX: Tensor,
    row_start_G1: Tensor,
    block_start_G1: Tensor,
    num_blocks: int,
    *,
    index_R: Tensor | None = None,
    out: FP8Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> FP8Tensor:
    """The packed wgrad operand of ``src_RX`` (rows ``src_RX[index_R[r]]`` with ``index_R``: the fused
    dispatch gather): columns past ``128 block_start[G]`` are left unwritten and never read. Written
    into ``out`` when given (an :func:`empty_segments`-shaped operand, e.g. from :func:`segments_in`).
    ``tile``: a program's (columns, warps), by default :data:`SEGMENT_TILE` on a GPU and 16 columns in
    the interpreter; the bytes are the same for any."""
    check_rows(src_RX)
    X = src_RX.shape[1]
    G = row_start_G1.shape[0] - 1
    out = empty_segments(X, num_blocks, src_RX.device) if out is None else out
    if num_blocks == 0 or X == 0 or G == 0:
        return out
    cuda = src_RX.device.type == "cuda"
    columns, warps = tile or (SEGMENT_TILE if cuda else (16, 1))
    block_x = min(next_power_of_2(X), columns)
    quantize_segments_kernel[(num_blocks, cdiv(X, block_x))](
        src_RX,
        index_R,
        row_start_G1,
        block_start_G1,
        out.data.view(torch.uint8),
        out.scale,
        G,
        X,
        src_RX.stride(0),
        0,
        out.data.stride(0),
        0,
        out.scale.stride(0),
        out.scale.stride(1),
        HAS_INDEX=index_R is not None,
        PACKED=True,
        WHOLE_BLOCKS=False,
        BINS=next_power_of_2(G),
        BLOCK_X=block_x,
        TILE=TILE,
        QUANTIZE_ALONG_ROWS=quantize_along_rows,
        num_warps=warps,
    )
    return out


@triton.jit
def _quantize_blocks_kernel(
    src_ptr,
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    Y,
    X,
    stride_g,
    stride_y,
    stride_x,
    BOTH: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    by = tl.program_id(1)
    bx = tl.program_id(2)
    offs_y = by * 128 + tl.arange(0, 128)
    offs_x = bx * 128 + tl.arange(0, 128)
    mask = (offs_y < Y)[:, None] & (offs_x < X)[None, :]
    ptrs = src_ptr + g * stride_g + offs_y[:, None].to(tl.int64) * stride_y + offs_x[None, :] * stride_x
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    elements, scale = quantize_block(v)
    codes = elements.to(tl.uint8)
    out = data_ptr + g * Y * X + offs_y[:, None].to(tl.int64) * X + offs_x[None, :]
    tl.store(out, codes, mask=mask)
    tl.store(scale_ptr + (g * tl.num_programs(1) + by) * tl.num_programs(2) + bx, scale)
    if BOTH:  # the block's transpose is a block of w^T with the same scale
        out_t = data_t_ptr + g * X * Y + offs_x[:, None].to(tl.int64) * Y + offs_y[None, :]
        tl.store(out_t, tl.trans(codes), mask=tl.trans(mask))
        tl.store(scale_t_ptr + (g * tl.num_programs(2) + bx) * tl.num_programs(1) + by, scale)


def empty_weight(shape: tuple[int, ...], device: torch.device) -> FP8Tensor:
    """Uninitialised ``[G, Y, X]`` FP8 weight buffers in 128×128 blocks (scales contiguous)."""
    G, Y, X = shape
    return FP8Tensor(
        data=torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
        scale=torch.empty(G, -(-Y // TILE), -(-X // TILE), dtype=torch.float32, device=device),
        tile=(1, TILE, TILE),
    )


def _check_weight_out(out: FP8Tensor, shape: tuple[int, int, int]) -> None:
    if tuple(out.data.shape) != shape or not out.data.is_contiguous() or not out.scale.is_contiguous():
        raise ValueError(f"out: expected contiguous FP8 buffers {list(shape)}, got {tuple(out.data.shape)}")


def _quantize_blocks(source: Tensor, out: FP8Tensor, out_t: FP8Tensor | None) -> None:
    G, Y, X = source.shape
    if source.numel() == 0:
        return
    _quantize_blocks_kernel[(G, cdiv(Y, TILE), cdiv(X, TILE))](
        source,
        out.data.view(torch.uint8),
        out.scale,
        out.data.view(torch.uint8) if out_t is None else out_t.data.view(torch.uint8),
        out.scale if out_t is None else out_t.scale,
        Y,
        X,
        source.stride(0),
        source.stride(1),
        source.stride(2),
        BOTH=out_t is not None,
        num_warps=16 if source.device.type == "cuda" else 1,  # faster than 8 or 32 on an H200
    )


def quantize_weight(source: Tensor, out: FP8Tensor) -> None:
    """Fill ``out`` (:func:`empty_weight`) with ``source [G, Y, X]`` (``w`` or ``w.transpose(1, 2)``,
    any strides) in 128×128 blocks: one pass, the transposed form read through the view."""
    G, Y, X = source.shape
    _check_weight_out(out, (G, Y, X))
    _quantize_blocks(source, out, None)


def quantize_weight_both(w: Tensor, out: FP8Tensor, out_t: FP8Tensor) -> None:
    """Fill ``out`` with ``w [G, Y, X]`` and ``out_t`` with ``w^T [G, X, Y]`` in 128×128 blocks in one pass
    over ``w``: each block is read once and stored twice, as is and transposed (same scale)."""
    G, Y, X = w.shape
    _check_weight_out(out, (G, Y, X))
    _check_weight_out(out_t, (G, X, Y))
    _quantize_blocks(w, out, out_t)
