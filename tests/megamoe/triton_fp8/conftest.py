"""Fixtures of the FP8 kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def hopper() -> torch.device:
    """The CUDA device, when it has Hopper's MMA (compute capability 9.x) for the Gluon FP8 kernels."""
    from megamoe.backends.triton_fp8 import wgmma_gemm

    device = torch.device("cuda")
    if not wgmma_gemm.supported(device):
        pytest.skip("the Gluon FP8 kernels run on compute capability 9.x (Hopper) only")
    return device
