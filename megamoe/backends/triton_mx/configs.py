"""Tile shapes of the MXFP8 kernels, from static shapes only (no autotuning: it syncs and breaks capture).

Not tuned yet: chosen for register room, not measured. The fp8 MMA result of each 32-deep step is a
fresh fp32 tile that is scaled and added to the accumulator on the CUDA cores, so a tile holds two
fp32 tiles (accumulator + partial product): 128x128 with 8 warps keeps both at 64 registers a thread,
where the bf16 path's 128x256 would need 256. ``SUB`` 32-deep steps share one pipeline stage (one
loop iteration): fewer, larger iterations for the software pipeliner. Sweep BLOCK_N, SUB, warps and
stages on the H200 before trusting any number. The CPU interpreter gets tiny tiles.
"""

from __future__ import annotations

import torch

from megamoe.backends.triton.configs import block_m

_GPU_GEMM = {"BLOCK_N": 128, "SUB": 2, "num_warps": 8, "num_stages": 4}
_GPU_WGRAD = {"BLOCK_M": 128, "BLOCK_N": 128, "SUB": 1, "num_warps": 8, "num_stages": 4}


def gemm_config(device: torch.device) -> dict:
    """Tile of the M-grouped MX GEMM (every row-grouped GEMM: fc1/fc2 forward and dgrad)."""
    if device.type != "cuda":
        return {"BLOCK_M": block_m(device), "BLOCK_N": 16, "SUB": 2, "num_warps": 1, "num_stages": 1}
    return {"BLOCK_M": block_m(device), **_GPU_GEMM}


def wgrad_config(device: torch.device) -> dict:
    """Tile of the K-grouped MX weight-gradient GEMM."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "SUB": 2, "num_warps": 1, "num_stages": 1}
    return dict(_GPU_WGRAD)
