"""Memory traffic at a set pace beside a kernel on one GPU: a stand-in for a peer's NVLink stores.

At EP = 2 the peer's GEMM2 and GEMM1-dgrad store about half of their output rows into this GPU's
memory while this GPU runs the same GEMM (DeepSeek-V3: 470 MB in 3-6 ms). Those writes land in this
GPU's L2 beside the GEMM's reused weight tiles. One GPU cannot receive NVLink stores, but it can
write the same bytes at the same pace from a few small programs beside the GEMM, which separates the
cost of the traffic landing here from the cost of issuing remote stores (benchmarks/sweep_tiles.py
``--beside inbound``).

:class:`PacedWrites` spreads ``nbytes`` of stores evenly over ``seconds`` from ``PROGRAMS`` 4-warp
programs (a few registers each, no shared memory, so each fits on an SM beside a persistent GEMM
program), paced by the GPU's global timer; in the CPU interpreter, which runs no asm, unpaced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192
"""int32 words a program stores at a time (32 KB, a quarter of a 128 x 256 bf16 output tile)"""
PROGRAMS = 8
NUM_WARPS = 4


@triton.jit
def globaltimer_ns(x):
    """The GPU's global nanosecond timer; ``x`` is unused."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _paced_writes_kernel(
    dst_ptr, num_chunks, interval_ns, num_programs, CHUNK: tl.constexpr, PACED: tl.constexpr
):
    """Chunk ``c`` of ``dst`` is written once ``c * interval_ns`` passed since the program started
    (``PACED``; else at once)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    value = tl.full((CHUNK,), 1, tl.int32)
    if PACED:
        due = globaltimer_ns(pid) + pid * interval_ns  # int64 from here on
    for c in range(pid, num_chunks, num_programs):
        if PACED:
            now = globaltimer_ns(pid)
            while now < due:
                now = globaltimer_ns(pid)
            due += num_programs * interval_ns
        tl.store(dst_ptr + c * CHUNK + offs, value)  # under 2**31 words: the buffer's size check


class PacedWrites:
    """``nbytes`` (rounded up to whole chunks) written at an even pace over ``seconds``."""

    def __init__(self, nbytes: int, seconds: float, device: torch.device) -> None:
        if nbytes <= 0 or seconds <= 0:
            raise ValueError(f"PacedWrites needs nbytes > 0 and seconds > 0, got {nbytes} and {seconds}")
        self.num_chunks = triton.cdiv(nbytes, 4 * CHUNK)
        if self.num_chunks * CHUNK >= 2**31:
            raise ValueError(f"PacedWrites writes under 8 GiB at a time, not {nbytes} bytes")
        self.buffer = torch.empty(self.num_chunks * CHUNK, dtype=torch.int32, device=device)
        self.interval_ns = max(int(seconds * 1e9 / self.num_chunks), 0)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def launch(self) -> None:
        """Enqueue the writes on the current stream."""
        _paced_writes_kernel[(PROGRAMS,)](
            self.buffer,
            self.num_chunks,
            self.interval_ns,
            PROGRAMS,
            CHUNK=CHUNK,
            PACED=self.buffer.is_cuda,  # the interpreter runs no asm
            num_warps=NUM_WARPS,
        )
