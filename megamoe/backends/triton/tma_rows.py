"""The side gather's rows moved by the TMA unit (Hopper and later), in Gluon: no row through registers.

Beside a persistent dgrad GEMM, any row copy driven by SM instructions slows the GEMM, whatever its
pace, cache hints, bytes or placement (measured with ``benchmarks/profile_side_gather.py``:
docs/history/kernels.md#what-a-row-copy-costs-beside-a-persistent-gemm). Here one warp a program only issues bulk tensor copies: for each
``ROWS x BOX`` chunk of a row block it loads the ROWS source rows (``[1, BOX]`` boxes, the gather) into a
shared-memory stage and stores the stage as one ``[ROWS, BOX]`` box; loads run ``AHEAD`` chunks before
the stores, each stage's barrier counting its loads' bytes. Beside the same GEMMs it costs them less than a
register copy does (docs/history/kernels.md#the-tma-unit).

The program is small enough to sit beside a dgrad program on every SM: one warp, ~34 registers, 16.5 KB
of shared memory (checked by the sm_90a compile tests). Row blocks come from a device counter, as in
:func:`megamoe.backends.triton.side_gather.gather_rows`, which picks this kernel where
:func:`supported` says it can run.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 8  # rows of a store box
BOX = 256  # columns of a box: TMA's widest (512 bytes of bf16)
STAGES = 4  # shared-memory stages of ROWS x BOX
AHEAD = 2  # chunks the loads run ahead of the stores
NUM_WARPS = 1
MIN_TRITON = (3, 6)  # the Gluon API this is written against
_TRITON_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= MIN_TRITON


@gluon.jit
def _tma_gather_rows_kernel(
    src_desc,
    out_desc,
    index_ptr,
    R,
    H,
    next_block_ptr,
    ROWS: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """``out[r] = src[index[r]]`` for ``r < R``, ROWS-row blocks taken from the counter ``next_block``."""
    bufs = gl.allocate_shared_memory(out_desc.dtype, [STAGES, ROWS, BOX], out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # the barriers initialised before the copy engine sees them
    chunks = gl.cdiv(H, BOX)
    issued = 0  # chunks this program has loaded: their stage and barrier phase follow from it
    block = gl.atomic_add(next_block_ptr, 1)
    while block < gl.cdiv(R, ROWS):
        r0 = block * ROWS
        for c in range(chunks + AHEAD):
            if c < chunks:
                stage = (issued + c) % STAGES
                tma.store_wait(STAGES - AHEAD - 1)  # the store that last read this stage is done
                bar = bars.index(stage)
                mbarrier.expect(bar, ROWS * BOX * out_desc.dtype.primitive_bitwidth // 8)
                for r in gl.static_range(ROWS):
                    token = gl.load(index_ptr + gl.minimum(r0 + r, R - 1))  # rows past R: never stored
                    tma.async_copy_global_to_shared(
                        src_desc, [token, c * BOX], bar, bufs.index(stage).slice(r, 1)
                    )
            if c >= AHEAD:
                done = issued + c - AHEAD
                mbarrier.wait(bars.index(done % STAGES), (done // STAGES) & 1)
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [r0, (c - AHEAD) * BOX], bufs.index(done % STAGES))
        issued += chunks
        block = gl.atomic_add(next_block_ptr, 1)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def supported(src_TH: Tensor, out_RH: Tensor) -> bool:
    """Whether the TMA gather can move these rows: an NVIDIA GPU of compute capability 9 or later, Triton
    3.6 or later, 2-byte rows a multiple of 16 bytes long and 16 bytes apart, both bases 16-byte aligned."""
    if not src_TH.is_cuda or torch.version.hip is not None or src_TH.element_size() != 2:
        return False
    if torch.cuda.get_device_capability(src_TH.device)[0] < 9:
        return False
    if not _TRITON_OK:
        return False
    rows_ok = src_TH.shape[1] % 8 == 0 and src_TH.stride(0) % 8 == 0 and src_TH.stride(1) == 1
    return rows_ok and src_TH.data_ptr() % 16 == 0 and out_RH.data_ptr() % 16 == 0


def tma_gather_rows(src_TH: Tensor, index_R: Tensor, out_RH: Tensor, next_block: Tensor, grid: int) -> None:
    """``out_RH = src_TH[index_R]`` on ``grid`` programs; ``next_block`` is a zeroed int32 counter."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * src_TH.element_size(), rank=2)
    src_desc = TensorDescriptor.from_tensor(src_TH, [1, BOX], layout)
    out_desc = TensorDescriptor.from_tensor(out_RH, [ROWS, BOX], layout)
    _tma_gather_rows_kernel[(grid,)](
        src_desc,
        out_desc,
        index_R,
        out_RH.shape[0],
        src_TH.shape[1],
        next_block,
        ROWS=ROWS,
        BOX=BOX,
        STAGES=STAGES,
        AHEAD=AHEAD,
        num_warps=NUM_WARPS,
    )
