"""Where the Gluon FP8 kernels store their tiles, checked on the CPU (the kernels themselves need a
Hopper GPU: ``test_gpu_wgmma_gemm.py``, ``test_gpu_wgmma_wgrad.py``): the TMA descriptors of the
outputs, and the M-grouped ring's depth beside the staging buffers."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton_fp8 import wgmma_gemm, wgmma_wgrad
from megamoe.backends.triton_fp8.configs import GPU_WGMMA


def test_a_column_range_of_a_weight_gradient_is_stored_as_rows_of_every_expert() -> None:
    dw = torch.empty(4, 256, 512, dtype=torch.bfloat16)  # [G, M, N]
    desc = wgmma_wgrad._out_descriptor(dw[:, :, 128:256], 128)
    assert list(desc.shape) == [4 * 256, 128]  # columns past the range: dropped by TMA
    assert list(desc.strides) == [512, 1]  # expert g's row m at row g M + m
    assert desc.base.data_ptr() == dw[0, 0, 128].data_ptr()


def test_experts_that_do_not_follow_on_are_refused() -> None:
    with pytest.raises(ValueError, match="experts' rows must follow on"):
        wgmma_wgrad._out_descriptor(torch.empty(256, 4, 512, dtype=torch.bfloat16).transpose(0, 1), 128)


def test_rows_tma_cannot_store_are_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes apart"):
        wgmma_gemm.out_descriptor(torch.empty(10, 7, dtype=torch.bfloat16), 64)


@pytest.mark.parametrize(
    ("dtype", "stages", "staged"), [(torch.bfloat16, 4, True), (torch.float32, 5, False)]
)
def test_only_a_bf16_output_is_staged_its_buffers_taking_one_stage(dtype, stages, staged) -> None:
    out = torch.empty(0, dtype=dtype)
    assert wgmma_gemm._staged(out) is staged
    assert wgmma_gemm._stages(GPU_WGMMA, out) == stages
