"""The warp-specialised Gluon FP8 GEMM on a Hopper GPU (device machine only): the same bits as the
Triton FP8 GEMM it replaces there, over ragged routings.

``pytest -m gpu tests/megamoe/triton_fp8/test_gpu_wgmma_gemm.py``. Both kernels add the same fp32
products in the same order (one 128-deep MMA, then one scaled add per K tile), so their outputs must be
equal bit for bit: empty experts, one row, segments that end mid-tile, N not a multiple of the tile
(a tile's B rows then run into the next expert's, whose columns are never stored), K not a multiple of
128 (TMA's zero fill), fp32 and bf16 outputs, rows gathered first and rows in order.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton_fp8 import wgmma_gemm
from megamoe.backends.triton_fp8.configs import GPU_WGMMA, gemm_config
from megamoe.backends.triton_fp8.grouped_gemm import fp8_grouped_gemm
from megamoe.backends.triton_fp8.quantize import (
    empty_weight,
    gather_rows,
    quantize_rows,
    quantize_weight,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("tokens", "experts", "K", "N", "out_dtype"),
    [
        (300, 8, 272, 320, torch.bfloat16),  # odd experts empty, K % 128 != 0, N % 128 != 0
        (1, 4, 128, 64, torch.bfloat16),  # one token: a single short tile
        (3, 16, 4096, 1536, torch.float32),  # fc2 dgrad's fp32 output
        (4096, 16, 4096, 1536, torch.bfloat16),  # many tiles per program: the ring crosses tiles
    ],
)
@pytest.mark.parametrize("gathered", [False, True])
def test_wgmma_gemm_same_bits_as_the_triton_gemm(hopper, tokens, experts, K, N, out_dtype, gathered) -> None:
    device = hopper
    torch.manual_seed(0)
    first = torch.randint(0, experts // 2, (tokens, 1), device=device) * 2  # even experts only
    idx = torch.cat([first, (first + 2) % experts], dim=1)
    plan = build_routing_plan(idx, num_experts=experts, block_m=GPU_WGMMA.block_m)
    R = idx.numel()
    w = torch.randn(experts, N, K, device=device, dtype=torch.bfloat16)
    qw = empty_weight((experts, N, K), device)
    quantize_weight(w, qw)
    if gathered:  # fc1 forward, fc2 dgrad: the source rows, gathered through the plan
        qa = quantize_rows(torch.randn(tokens, K, device=device, dtype=torch.bfloat16))
        a_rows = plan.row_token_R
    else:
        qa, a_rows = quantize_rows(torch.randn(R, K, device=device, dtype=torch.bfloat16)), None
    ref = torch.zeros(R, N, device=device, dtype=out_dtype)
    config = gemm_config(device, gather=gathered)
    fp8_grouped_gemm(qa, qw, ref, plan, config=config, num_sms=num_programs(device), a_rows=a_rows)
    out = torch.zeros(R, N, device=device, dtype=out_dtype)
    a = gather_rows(qa, a_rows) if gathered else qa
    wgmma_gemm.wgmma_fp8_grouped_gemm(a, qw, out, plan, config=GPU_WGMMA, num_sms=num_programs(device))
    assert ref.abs().max() > 0
    assert torch.equal(out, ref)


def test_gather_rows_moves_data_and_scales(hopper) -> None:
    device = hopper
    qa = quantize_rows(torch.randn(50, 384, device=device, dtype=torch.bfloat16))
    index = torch.randint(0, 50, (77,), device=device, dtype=torch.int32)
    got = gather_rows(qa, index)
    assert torch.equal(got.data.view(torch.uint8), qa.data.view(torch.uint8)[index.long()])
    assert torch.equal(got.scale, qa.scale[index.long()])
