"""A transient row gather that runs beside the next GEMM instead of before it.

Backward needs ``x`` and ``dy`` in expert order for the TMA-fed weight gradients (row-gathered
operands slow the wgrad: docs/kernels.md#measurements-that-chose-the-design). Each gather is
memory-bound (docs/history/kernels.md#the-backwards-row-gathers), while the grouped GEMM before the
wgrad is compute-bound and persistent: one 8-warp program per SM holding at most ``GEMM_REGISTER_CAP``
registers a thread (56K of the SM's 64K) and ~180 KB of its shared memory, with warp slots and DRAM
bandwidth to spare. The gather here is persistent too, and small enough to fit beside it: on Hopper
one warp a program that only issues TMA copies (:mod:`.tma_rows`: ~34 registers, 16.5 KB of shared
memory), elsewhere one 4-warp program per SM, no shared memory, at most ``GATHER_MAX_REGISTERS`` a
thread (both checked by the sm_90a compile tests; a GEMM over the cap gets it as its ``maxnreg``).
Launched on a side stream around the GEMM's launch, it runs in those gaps in whichever order the
hardware starts the two.
torch's ``index_select`` does not: its thousands of blocks, started first, fill every SM and the GEMM
waits for all of them (docs/history/kernels.md#beside-the-dgrads).

Usage, all inside one op (every gather started is joined before the op returns, so nothing the side
stream reads or writes outlives the op's stream order)::

    gather = RowGather(src_TH, index_R)   # output allocated, fork point recorded on this stream
    grouped_gemm(...)                     # the kernel to hide under
    gather.start()                        # the gather, on the side stream
    ...
    rows_RH = gather.rows()               # this stream waits for the side stream

Off CUDA (the CPU interpreter) everything runs in order on the one stream there is, and so do gathers
of less than ``SIDE_STREAM_MIN_BYTES``: the fork and join cost the host more than such a copy costs
the GPU (at small T the host's time is the layer's time). On CUDA those run as one ``index_select``:
a single launch, where the persistent gather needs a zeroed counter and, on Hopper, two TMA
descriptors built on the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.grid import cdiv

try:  # Gluon (triton.experimental.gluon) with Hopper's TMA ops; older Triton builds use the kernel below
    from megamoe.backends.triton import tma_rows
except ImportError:
    tma_rows = None

BLOCK_R = 8  # rows per step: 8 x 1024 bf16 is 128 bytes (eight 16-byte loads) in flight per thread
BLOCK_H = 1024
NUM_WARPS = 4
GEMM_REGISTER_CAP = 224
"""registers a thread of an 8-warp GEMM program that a gather runs beside may hold"""
GATHER_MAX_REGISTERS = (65536 - 256 * GEMM_REGISTER_CAP) // (32 * NUM_WARPS)
"""64: what is left of an SM's 64K registers, over the gather program's 128 threads"""
SIDE_STREAM_MIN_BYTES = 128 << 20
"""gathered bytes from which a gather runs on the side stream. Below it the fork, the join and the
persistent launch cost the host more than the copy costs the GPU, and a layer this small is bound by its
host time: ``benchmarks/ab_small_t_paths.py``, docs/benchmarks.md#small-token-counts-eager-and-in-cuda-graphs."""


@triton.jit
def copy_rows_streaming(from_rows, to_rows, ok, H, BLOCK_H: tl.constexpr):
    """``to_rows[r][:H] = from_rows[r][:H]`` for the rows where ``ok`` (row start pointers), streamed
    through L2 (evict first) so that the GEMM beside it keeps its reused tiles there."""
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = ok[:, None] & (cols < H)[None, :]
        v = tl.load(from_rows[:, None] + cols[None, :], mask=mask, eviction_policy="evict_first")
        tl.store(to_rows[:, None] + cols[None, :], v, mask=mask, eviction_policy="evict_first")


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    index_ptr,
    out_ptr,
    next_block_ptr,
    R,
    H,
    stride_src,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r] = src[index[r]]`` for every ``r < R``, in blocks of ``BLOCK_R`` rows that each program of a
    persistent grid takes from the device counter ``next_block`` (zero at launch) until none is left."""
    block = tl.atomic_add(next_block_ptr, 1)
    while block < tl.cdiv(R, BLOCK_R):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        src_row = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        copy_rows_streaming(
            src_ptr + src_row * stride_src, out_ptr + rows.to(tl.int64) * H, row_ok, H, BLOCK_H
        )
        block = tl.atomic_add(next_block_ptr, 1)


def gather_rows(src_TH: Tensor, index_R: Tensor, out_RH: Tensor) -> None:
    """``out_RH = src_TH[index_R]`` (``out_RH`` contiguous; ``src_TH`` rows of unit column stride, so a
    column slice of a wider tensor too; ``index_R`` int32 in ``[0, T)``), one program per SM:
    by the TMA unit where :func:`.tma_rows.supported` (Hopper and later), else by the kernel above.

    The programs take row blocks from a counter rather than a fixed share each: beside a persistent GEMM
    some programs run slower than others, and a fixed share left the GEMM's op waiting for the slowest
    (``benchmarks/profile_side_gather.py``;
    docs/history/kernels.md#what-a-row-copy-costs-beside-a-persistent-gemm).
    """
    R, H = out_RH.shape
    if R == 0 or H == 0:
        return
    if tma_rows is not None and tma_rows.supported(src_TH, out_RH):
        grid = min(num_programs(src_TH.device), cdiv(R, tma_rows.ROWS))
        tma_rows.tma_gather_rows(src_TH, index_R, out_RH, _zeroed_counter(src_TH.device), grid)
    else:
        register_gather_rows(src_TH, index_R, out_RH)


def register_gather_rows(src_TH: Tensor, index_R: Tensor, out_RH: Tensor) -> None:
    """:func:`gather_rows` by :func:`_gather_rows_kernel`, the copy through registers, on any device (rows
    and columns not empty)."""
    R, H = out_RH.shape
    grid = min(num_programs(src_TH.device), cdiv(R, BLOCK_R))
    _gather_rows_kernel[(grid,)](
        src_TH, index_R, out_RH, _zeroed_counter(src_TH.device), R, H, src_TH.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS,
    )  # fmt: skip


def _zeroed_counter(device: torch.device) -> Tensor:
    """The gathers' row-block counter, zeroed on the launching stream (a CUDA graph replays the zeroing)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


class RowGather:
    """``src[index]`` gathered on a side stream between :meth:`start` and :meth:`rows`."""

    def __init__(self, src_TH: Tensor, index_R: Tensor) -> None:
        """``src_TH`` may be a column slice of a wider tensor (its rows are read in place)."""
        self._src = src_TH if src_TH.stride(-1) == 1 else src_TH.contiguous()
        self._index = index_R
        # allocated on the current stream, which frees it after the consumer: no record_stream needed
        self._out = src_TH.new_empty(index_R.numel(), src_TH.shape[1])
        self._side: torch.cuda.Stream | None = None
        if src_TH.is_cuda and self._out.nbytes >= SIDE_STREAM_MIN_BYTES:
            self._side = _side_stream(src_TH.device.index)
            # the fork point: the side stream sees everything enqueued so far (the source, the index,
            # earlier users of the output's memory) and nothing enqueued after, i.e. not the GEMM
            self._side.wait_stream(torch.cuda.current_stream(src_TH.device))
        self._started = False

    def start(self) -> None:
        """Enqueue the gather (on the side stream where it has one): call it right after the GEMM's
        launch."""
        if self._side is None and self._src.is_cuda:
            torch.index_select(self._src, 0, self._index, out=self._out)
        elif self._side is None:
            gather_rows(self._src, self._index, self._out)
        else:
            with torch.cuda.stream(self._side):
                gather_rows(self._src, self._index, self._out)
        self._started = True

    def rows(self) -> Tensor:
        """The gathered rows, ready for kernels enqueued on the current stream from now on."""
        if not self._started:
            raise RuntimeError("RowGather.rows() before start()")
        if self._side is not None:
            torch.cuda.current_stream(self._src.device).wait_stream(self._side)
        return self._out
