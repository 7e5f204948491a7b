"""The warp-specialised Gluon FP8 weight gradient on a Hopper GPU (device machine only): the same bits
as the Triton K-grouped kernel it replaces there, over ragged routings, and the same bits on every run.

``pytest -m gpu tests/megamoe/triton_fp8/test_gpu_wgmma_wgrad.py``. Both kernels add the same fp32
products in the same order (one 128-deep MMA, scaled by the column then the row scale, added per
128-row block), so their outputs must be equal bit for bit: empty experts (their gradient is zeros,
written over whatever the buffer held), experts whose rows end inside a block, M and N not multiples
of the tile, an expert with one row, a program whose ring crosses many tiles.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton.configs import num_programs
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton_fp8 import wgmma_wgrad
from megamoe.backends.triton_fp8.configs import GPU_WGMMA_WGRAD, wgrad_config
from megamoe.backends.triton_fp8.quantize import quantize_segments, segment_block_starts
from megamoe.backends.triton_fp8.wgrad import fp8_wgrad

pytestmark = pytest.mark.gpu


def _operands(tokens: int, experts: int, M: int, N: int, device: torch.device):
    torch.manual_seed(0)
    first = torch.randint(0, experts // 2, (tokens, 1), device=device) * 2  # even experts only
    idx = torch.cat([first, (first + 2) % experts], dim=1)
    plan = build_routing_plan(idx, num_experts=experts, block_m=128)
    R = idx.numel()
    block_start = segment_block_starts(plan.expert_start_G1)
    num_blocks = -(-R // 128) + experts
    p_rows = torch.randn(R, M, device=device, dtype=torch.bfloat16)
    q_src = torch.randn(tokens, N, device=device, dtype=torch.bfloat16)
    p = quantize_segments(p_rows, plan.expert_start_G1, block_start, num_blocks)
    q = quantize_segments(q_src, plan.expert_start_G1, block_start, num_blocks, index_R=plan.row_token_R)
    return p, q, block_start


@pytest.mark.parametrize(
    ("tokens", "experts", "M", "N"),
    [
        (300, 8, 320, 272),  # odd experts empty, M and N not multiples of 128
        (1, 4, 128, 64),  # one row per routed expert: a single short block
        (2048, 4, 512, 384),  # many blocks per tile
        (4096, 16, 1024, 768),  # many tiles per program: the ring crosses tiles
    ],
)
def test_wgmma_wgrad_same_bits_as_the_triton_wgrad(hopper, tokens, experts, M, N) -> None:
    device = hopper
    p, q, block_start = _operands(tokens, experts, M, N, device)
    sms = num_programs(device)
    ref = torch.full((experts, M, N), float("nan"), device=device, dtype=torch.bfloat16)
    fp8_wgrad(p, q, ref, block_start, config=wgrad_config(device), num_sms=sms)
    out = torch.full((experts, M, N), float("nan"), device=device, dtype=torch.bfloat16)
    wgmma_wgrad.wgmma_fp8_wgrad(p, q, out, block_start, config=GPU_WGMMA_WGRAD, num_sms=sms)
    assert ref[0].abs().max() > 0
    assert not out[1].any(), "an expert without rows has a zero gradient"
    assert torch.equal(out, ref)
    again = torch.empty_like(out)
    wgmma_wgrad.wgmma_fp8_wgrad(p, q, again, block_start, config=GPU_WGMMA_WGRAD, num_sms=sms)
    assert torch.equal(again, out)
