"""Tile shapes of the MXFP8 kernels, from static shapes only (no autotuning: it syncs and breaks capture).

The one place to change a launch: ``benchmarks/sweep_mx_gemm.py`` times candidates from here.

Each 32-deep E4M3 MMA (Hopper ``wgmma`` k=32) produces a fresh fp32 partial tile that is scaled and
added to the accumulator on the CUDA cores, and Triton 3.6 waits for every such MMA before the scaling
(docs/mxfp8.md), so one program cannot overlap its MMA with its multiply-adds. The defaults run two
one-warpgroup programs per SM (``block_n=64``, 4 warps, ``programs_per_sm=2``) that overlap each
other's, faster than one 128x128 / 8-warp program per SM with the same bits in every MX GEMM
(``benchmarks/sweep_mx_gemm.py``: docs/benchmarks.md#mxfp8-gemms-alone). ``BLOCK_K`` is the K depth
of one pipeline stage: its ``BLOCK_K / 32`` MX blocks come as separate 32-deep TMA boxes, and one
``[rows, BLOCK_K / 32]`` scale tile per operand is loaded per stage, one stage ahead.
The CPU interpreter gets tiny tiles (two 32-deep steps per stage, so the split stays tested).
"""

from __future__ import annotations

import torch

from megamoe.backends.triton.configs import BLOCK_M_CPU, BLOCK_M_GPU, TileConfig

GPU_GEMM = TileConfig(
    block_m=BLOCK_M_GPU, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, programs_per_sm=2
)
"""M-grouped MX GEMM on CUDA (block_m is the routing plan's)."""
GPU_WGRAD = TileConfig(
    block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, programs_per_sm=2
)
"""K-grouped MX weight gradient on CUDA; ``block_k / 32`` must divide :data:`WGRAD_BLOCK_ALIGN`."""
WGRAD_BLOCK_ALIGN = 4
"""On CUDA, each expert's 32-row block slots along R are rounded up to a multiple of this (zero blocks), so a
wgrad stage of up to ``32 * WGRAD_BLOCK_ALIGN`` rows never reads another expert's blocks."""

_CPU_GEMM = TileConfig(block_m=BLOCK_M_CPU, block_n=16, block_k=64, group_m=8, num_warps=1, num_stages=1)
_CPU_WGRAD = TileConfig(block_m=16, block_n=16, block_k=64, group_m=8, num_warps=1, num_stages=1)


def gemm_config(device: torch.device) -> TileConfig:
    """Tile of the M-grouped MX GEMM (every row-grouped GEMM: fc1/fc2 forward and dgrad)."""
    return GPU_GEMM if device.type == "cuda" else _CPU_GEMM


def wgrad_config(device: torch.device) -> TileConfig:
    """Tile of the K-grouped MX weight-gradient GEMM."""
    return GPU_WGRAD if device.type == "cuda" else _CPU_WGRAD


def wgrad_block_align(device: torch.device) -> int:
    """Alignment of each expert's block slots along R (a multiple of the wgrad's ``block_k / 32``)."""
    return WGRAD_BLOCK_ALIGN if device.type == "cuda" else _CPU_WGRAD.block_k // 32
