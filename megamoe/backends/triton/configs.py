"""Launch configurations of the Triton kernels, chosen from static shapes only (no autotuning).

Autotuning would time kernels on the first call, which is a host sync and breaks CUDA-graph capture;
the table below won the tile sweeps on one H200 at the three bench shapes (docs/kernels.md). Under ``TRITON_INTERPRET=1`` on the CPU
the tiles are tiny so the logic tests stay fast.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M_GPU = 128
BLOCK_M_CPU = 16

_GPU = {
    # op: BLOCK_N, BLOCK_K, num_warps, num_stages
    "gemm1": (256, 64, 8, 3),
    "gemm2": (256, 64, 8, 3),
    "dgrad1": (256, 64, 8, 3),
    "dgrad2": (256, 64, 8, 3),
}
_WGRAD_GPU = (128, 256, 64, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages

# Variants of GEMM1 (row gather + SwiGLU epilogue) for benchmarks/sweep_gemm1.py: overrides of
# gemm_config("gemm1"). Kernel knobs (grouped_gemm.grouped_gemm's docstring) apply on every device;
# tile-shape knobs (BLOCK_K, GROUP_M, num_stages) only on the GPU, so the CPU tests stay small.
# Compiled for sm_90a on a CPU (triton 3.6): STORE_TMA=1's runtime branch (full tile: TMA, ragged:
# pointers) fails triton's nested-loop fusion, hence FLATTEN off there; flattened two-dots serialises
# its wgmmas (ptxas C7515), hence off too; tl.range(warp_specialize=True) leaves this loop (pointer
# loads of A) unspecialised, so it is no variant.
GEMM1_VARIANTS: dict[str, dict] = {
    "default": {},
    "tma-store": {"STORE_TMA": 1, "FLATTEN": False},
    "tma-store-dev": {"STORE_TMA": 2},
    "two-dots": {"SPLIT_GATE_UP": True, "FLATTEN": False},
    "two-dots+tma-store": {"SPLIT_GATE_UP": True, "STORE_TMA": 1, "FLATTEN": False},
    "not-flattened": {"FLATTEN": False},
    "tma-store-dev+group-m-16": {"STORE_TMA": 2, "GROUP_M": 16},
    # flattened, host-descriptor TMA stores without a branch: ragged last tiles shifted back to end at
    # the segment end, experts of < BLOCK_M rows by a second pointer-store launch (no convert_layout,
    # 168 registers, 213 KB shared memory when compiled for sm_90a)
    "tma-store-shifted": {"STORE_TMA": 3},
    "tma-store-shifted+group-m-16": {"STORE_TMA": 3, "GROUP_M": 16},
}
_KERNEL_KNOBS = ("STORE_TMA", "SPLIT_GATE_UP", "FLATTEN")


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


def gemm_config(op: str, device: torch.device, variant: str = "default") -> dict:
    """Tile shape of the M-grouped GEMM ``op`` (gemm1, gemm2, dgrad1, dgrad2); ``variant`` names an
    entry of :data:`GEMM1_VARIANTS` (gemm1 only)."""
    if variant not in GEMM1_VARIANTS:
        raise ValueError(f"unknown GEMM1 variant {variant!r}; known: {', '.join(GEMM1_VARIANTS)}")
    if variant != "default" and op != "gemm1":
        raise ValueError(f"variant {variant!r} is a GEMM1 variant; op is {op!r}")
    override = GEMM1_VARIANTS[variant]
    if device.type != "cuda":
        cfg = {"BLOCK_M": BLOCK_M_CPU, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
        return cfg | {k: v for k, v in override.items() if k in _KERNEL_KNOBS}
    bn, bk, warps, stages = _GPU[op]
    cfg = {"BLOCK_M": BLOCK_M_GPU, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
    return cfg | override


def wgrad_config(device: torch.device) -> dict:
    """Tile shape of the K-grouped weight-gradient GEMM."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    bm, bn, bk, warps, stages = _WGRAD_GPU
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
