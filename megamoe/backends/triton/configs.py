"""Launch configurations of the Triton kernels, chosen from static shapes only (no autotuning).

Autotuning would time kernels on the first call, which is a host sync and breaks CUDA-graph capture;
the table below won the tile sweeps on one H200 at the three bench shapes
(docs/benchmarks.md#every-gemm-at-its-default-tiles). Under ``TRITON_INTERPRET=1`` on the CPU the
tiles are tiny so the logic tests stay fast.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M_GPU = 128
BLOCK_M_CPU = 16

_GPU = {
    # op: BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M (M tiles per swizzle group). GEMM1's
    # GROUP_M 4 against 8: docs/history/kernels.md#tile-candidates-and-the-swizzle-group
    "gemm1": (256, 64, 8, 3, 4),
    "gemm2": (256, 64, 8, 3, 8),
    "dgrad1": (256, 64, 8, 3, 8),
    "dgrad2": (256, 64, 8, 3, 8),
}
_WGRAD_GPU = (128, 256, 64, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages


def block_m(device: torch.device) -> int:
    """Rows per tile of the routing plan and of every M-grouped GEMM."""
    return BLOCK_M_GPU if device.type == "cuda" else BLOCK_M_CPU


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per multiprocessor (4 in the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gemm_config(op: str, device: torch.device) -> dict:
    """Tile shape of the M-grouped GEMM ``op`` (gemm1, gemm2, dgrad1, dgrad2)."""
    if device.type != "cuda":
        return {"BLOCK_M": BLOCK_M_CPU, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    bn, bk, warps, stages, group_m = _GPU[op]
    return {
        "BLOCK_M": BLOCK_M_GPU,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
    }


def wgrad_config(device: torch.device) -> dict:
    """Tile shape of the K-grouped weight-gradient GEMM."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    bm, bn, bk, warps, stages = _WGRAD_GPU
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
