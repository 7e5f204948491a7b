"""Launch configurations of the Triton kernels, chosen from static shapes only (no autotuning).

Autotuning would time kernels on the first call, which is a host sync and breaks CUDA-graph capture;
the table below won the tile sweeps on one H200 at the three bench shapes
(docs/benchmarks.md#every-gemm-at-its-default-tiles). Under ``TRITON_INTERPRET=1`` on the CPU the
tiles are tiny so the logic tests stay fast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megamoe.backends.triton.grid import cdiv
from megamoe.errors import InvalidConfigError

BLOCK_M_GPU = 128
BLOCK_M_CPU = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class TileConfig:
    """The launch of one tiled GEMM kernel: its tile constexprs, launch options and persistent grid.

    A variant is ``dataclasses.replace(config, block_n=...)`` (the tile sweeps' candidates).
    """

    block_m: int
    """rows of an output tile (the M-grouped GEMMs: the routing plan's ``block_m``)"""
    block_n: int
    """columns of an output tile (three times a power of two where a kernel computes it in two pieces)"""
    block_k: int
    """K depth of one pipeline stage"""
    group_m: int = 8
    """M tiles per swizzle group: consecutive programs walk this many M tiles down one N column, so
    they share the column's B tiles in L2"""
    num_warps: int
    num_stages: int
    """software-pipeline depth: tiles of A and B in flight in shared memory"""
    programs_per_sm: int = 1
    """persistent programs per multiprocessor (read by the MX launchers: they multiply ``num_sms`` by
    it); not a kernel argument"""

    def __post_init__(self) -> None:
        for name in (
            "block_m",
            "block_n",
            "block_k",
            "group_m",
            "num_warps",
            "num_stages",
            "programs_per_sm",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"TileConfig.{name}", value, "must be a positive integer")
        for name in ("block_m", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise InvalidConfigError(
                    f"TileConfig.{name}", value, "must be a power of two (Triton's tile and warp counts)"
                )
        odd = self.block_n // (self.block_n & -self.block_n)  # block_n without its factors of 2
        if odd not in (1, 3):
            raise InvalidConfigError(
                "TileConfig.block_n",
                self.block_n,
                "must be a power of two, or three times one (a tile of two pieces: a power of two and its half)",
            )

    def launch_kwargs(self) -> dict[str, int]:
        """The kernel launch's keywords: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M`` (constexprs),
        ``num_warps`` and ``num_stages`` (launch options)."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


_GPU_GEMM = {
    # GEMM1's group_m 4 against 8: docs/history/kernels.md#tile-candidates-and-the-swizzle-group
    "gemm1": TileConfig(block_m=BLOCK_M_GPU, block_n=256, block_k=64, group_m=4, num_warps=8, num_stages=3),
    "gemm2": TileConfig(block_m=BLOCK_M_GPU, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    "dgrad1": TileConfig(block_m=BLOCK_M_GPU, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    "dgrad2": TileConfig(block_m=BLOCK_M_GPU, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
}
_CPU_GEMM = TileConfig(block_m=BLOCK_M_CPU, block_n=16, block_k=16, num_warps=4, num_stages=1)
_GPU_WGRAD = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
_CPU_WGRAD = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


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


def gemm_config(op: str, device: torch.device) -> TileConfig:
    """Tile shape of the M-grouped GEMM ``op`` (gemm1, gemm2, dgrad1, dgrad2)."""
    if device.type != "cuda":
        return _CPU_GEMM
    return _GPU_GEMM[op]


def wgrad_config(device: torch.device) -> TileConfig:
    """Tile shape of the K-grouped weight-gradient GEMM."""
    return _GPU_WGRAD if device.type == "cuda" else _CPU_WGRAD


WGRAD_OPERAND_CHUNK_BYTES = 128 << 20
"""about how many bytes of a wgrad's gathered operand (dW1's dispatched ``x``) are made and read at a
time: the operand is built in column chunks, so it never lives whole beside the other buffers of the
backward's peak"""


def column_chunks(rows: int, cols: int, element_size: int, multiple: int) -> list[tuple[int, int]]:
    """``[start, end)`` column ranges of about ``WGRAD_OPERAND_CHUNK_BYTES`` over ``rows`` rows, each a
    multiple of ``multiple`` wide (the wgrad's tile width) but the last; one range where all fits."""
    if cols == 0:
        return [(0, 0)]
    count = max(1, cdiv(rows * cols * element_size, WGRAD_OPERAND_CHUNK_BYTES))
    width = max(1, cdiv(cdiv(cols, count), multiple)) * multiple
    return [(start, min(start + width, cols)) for start in range(0, cols, width)]
