"""Tile shapes of the FP8 kernels, from static shapes only (no autotuning: it syncs and breaks capture).

A K stage is one 128-deep tile (one scale per operand row), and ``block_n`` divides 128 so an output
tile's columns share one weight scale per stage. After each 128-deep E4M3 MMA its fp32 partial is
scaled and added on the CUDA cores (one FMA per element, a quarter of MXFP8's per-32 cost); Triton
waits for the MMA before that FMA, so several programs per SM (one warpgroup each, 128x64 tiles)
overlap each other's MMA and FMA, which the two warpgroups of one 128x128 program, running in step,
do not. A GEMM whose rows come by TMA fits three programs on an SM (two pipeline stages); one that
gathers its rows holds more registers, and fits two. On Hopper the M-grouped GEMMs run the
warp-specialised Gluon kernel instead, whose MMA and promotion overlap inside one program.
``benchmarks/sweep_fp8_gemm.py`` times the candidates (docs/fp8.md). The CPU interpreter gets tiny
M and N tiles.
"""

from __future__ import annotations

import torch

from megamoe.backends.triton.configs import BLOCK_M_CPU, BLOCK_M_GPU, TileConfig

GPU_GEMM_GATHER = TileConfig(
    block_m=BLOCK_M_GPU, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3, programs_per_sm=2
)
"""M-grouped FP8 GEMM on CUDA that gathers its rows (block_m is the routing plan's)."""
GPU_GEMM_TMA = TileConfig(
    block_m=BLOCK_M_GPU, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=2, programs_per_sm=3
)
"""M-grouped FP8 GEMM on CUDA whose rows are in order (TMA)."""
GPU_WGMMA = TileConfig(
    block_m=BLOCK_M_GPU, block_n=192, block_k=128, group_m=8, num_warps=4, num_stages=5, programs_per_sm=1
)
"""The warp-specialised M-grouped FP8 GEMM on Hopper (:mod:`.wgmma_gemm`): 128 x 192 tiles (a 128- and
a 64-column piece), two 64-row consumer warpgroups and a producer warp, one program an SM (five 40 KB
stages; four beside a bf16 output's staging buffers)."""
GPU_WGMMA_WGRAD = TileConfig(
    block_m=128, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4, programs_per_sm=1
)
"""The warp-specialised K-grouped FP8 weight gradient on Hopper (:mod:`.wgmma_wgrad`): two 64-row
consumer warpgroups and a producer warp, one program an SM (four 32 KB stages: at DeepSeek-V3's dW1
and dW2 together faster than five or six on an H100)."""
GPU_WGRAD = TileConfig(
    block_m=128, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3, programs_per_sm=2
)
"""K-grouped FP8 weight gradient on CUDA."""
_CPU_GEMM = TileConfig(block_m=BLOCK_M_CPU, block_n=16, block_k=128, num_warps=1, num_stages=1)
_CPU_WGRAD = TileConfig(block_m=16, block_n=16, block_k=128, num_warps=1, num_stages=1)


def gemm_config(device: torch.device, *, gather: bool) -> TileConfig:
    """Tile of the M-grouped FP8 GEMM: ``gather`` for fc1 forward and fc2 dgrad (rows read through
    ``row_token``), not for fc2 forward and fc1 dgrad."""
    if device.type != "cuda":
        return _CPU_GEMM
    return GPU_GEMM_GATHER if gather else GPU_GEMM_TMA


def wgrad_config(device: torch.device) -> TileConfig:
    """Tile of the K-grouped FP8 weight-gradient GEMM."""
    return GPU_WGRAD if device.type == "cuda" else _CPU_WGRAD
