"""A transient row gather that runs beside the next GEMM instead of before it.

Backward needs ``x`` and ``dy`` in expert order for the TMA-fed weight gradients (row-gathered
operands cost the wgrad a third of its speed, docs/kernels.md). Each gather is memory-bound (0.45 ms
at DeepSeek-V3's per-rank shape on an H200), while the grouped GEMM before the wgrad is
compute-bound and persistent: one program per SM, with registers, warp slots and DRAM bandwidth to
spare. Launched on a side stream right after that GEMM, the gather's blocks run in those gaps, and
the wgrad waits for it only when it needs the rows.

Usage, all inside one op (every gather started is joined before the op returns, so nothing the side
stream reads or writes outlives the op's stream order)::

    gather = RowGather(src_TH, index_R)   # output allocated, fork point recorded on this stream
    grouped_gemm(...)                     # the kernel to hide under
    gather.start()                        # the gather, on the side stream
    ...
    rows_RH = gather.rows()               # this stream waits for the side stream

Off CUDA (the CPU interpreter) the gather runs at ``start()`` on the only stream there is.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


class RowGather:
    """``src[index]`` gathered on a side stream between :meth:`start` and :meth:`rows`."""

    def __init__(self, src_TH: Tensor, index_R: Tensor) -> None:
        self._src, self._index = src_TH, index_R
        # allocated on the current stream, which frees it after the consumer: no record_stream needed
        self._out = src_TH.new_empty(index_R.numel(), src_TH.shape[1])
        self._side: torch.cuda.Stream | None = None
        if src_TH.is_cuda:
            self._side = _side_stream(src_TH.device.index)
            # the fork point: the side stream sees everything enqueued so far (the source, the index,
            # earlier users of the output's memory) and nothing enqueued after, i.e. not the GEMM
            self._side.wait_stream(torch.cuda.current_stream(src_TH.device))
        self._started = False

    def start(self) -> None:
        """Enqueue the gather (on the side stream on CUDA): call it right after the GEMM's launch."""
        if self._side is None:
            torch.index_select(self._src, 0, self._index, out=self._out)
        else:
            with torch.cuda.stream(self._side):
                torch.index_select(self._src, 0, self._index, out=self._out)
        self._started = True

    def rows(self) -> Tensor:
        """The gathered rows, ready for kernels enqueued on the current stream from now on."""
        if not self._started:
            raise RuntimeError("RowGather.rows() before start()")
        if self._side is not None:
            torch.cuda.current_stream(self._src.device).wait_stream(self._side)
        return self._out
