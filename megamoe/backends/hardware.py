"""What a CUDA GPU's compute capability means for the quantised expert precisions, said once.

MXFP8 needs block-scaled MMA (compute capability 10 and up: Blackwell) to run at FP8 speed. Below that
(Hopper and older) the MXFP8 kernels rescale every 32-deep E4M3 MMA's partial sum on the CUDA cores,
and the layer runs at about a third of the bf16 path (docs/benchmarks.md). DeepSeek-V3's blockwise
FP8 promotes only every 128 of K, the format that suits those GPUs.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BLOCK_SCALED_MMA = 10
"""the first compute capability (major) with block-scaled MMA."""

_warned = False


def mxfp8_speed_warning(capability: tuple[int, int]) -> str | None:
    """The warning for MXFP8 kernels built for a GPU of compute ``capability`` (``(major, minor)``), or
    None where it has block-scaled MMA."""
    major, minor = capability
    if major >= BLOCK_SCALED_MMA:
        return None
    return (
        f"precision='mxfp8' on a GPU of compute capability {major}.{minor}, without block-scaled MMA: "
        "the MXFP8 kernels run at about 0.35x the bf16 path here, because each 32-deep E4M3 MMA's partial "
        "sum is rescaled on the CUDA cores. precision='fp8' (DeepSeek-V3's blockwise FP8, promoted every "
        "128 of K) is the format for this GPU, with Triton kernels for it (docs/fp8.md)"
    )


def warn_mxfp8_speed_once(capability: tuple[int, int]) -> None:
    """Log :func:`mxfp8_speed_warning` once per process, if there is one."""
    global _warned
    message = mxfp8_speed_warning(capability)
    if message is not None and not _warned:
        _warned = True
        logger.warning(message)
