"""The FP8 SwiGLU backward pass on its own: the routed rows' gradients against the formula, and the
padding rows (dropped slots) zeroed by the same launch.

Runs under ``TRITON_INTERPRET=1`` on the CPU (float32) and on a GPU alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton_fp8.experts import FP8Experts
from megamoe.backends.triton_fp8.swiglu import swiglu_backward_quant
from tests.megamoe.triton_mx.test_quantize import DEVICE


@pytest.mark.parametrize(
    ("T", "K", "G", "I", "drop"),
    [(40, 2, 3, 48, 0.0), (100, 4, 3, 32, 0.9), (9, 2, 4, 16, 1.0)],
    ids=["nothing-dropped", "most-dropped-several-programs-zero", "all-dropped"],
)
def test_swiglu_backward_writes_routed_rows_and_zeroes_padding_rows(T, K, G, I, drop) -> None:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    plan = FP8Experts.row_plan(build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=16))
    R = T * K
    h = torch.randn(R, 2 * I, generator=g).to(DEVICE)
    da = torch.randn(R, I, generator=g).to(DEVICE)
    weight = torch.rand(R, generator=g).to(DEVICE)
    dh = torch.full((R, 2 * I), float("nan"), device=DEVICE)
    d_weight = torch.full((R,), float("nan"), device=DEVICE)

    r = plan.routing
    swiglu_backward_quant(
        h, da, weight, dh, d_weight, r.expert_start_G1, plan.block_start_G1, plan.num_blocks
    )

    valid = int(r.expert_start_G1[-1])
    gate, up = h[:valid, :I], h[:valid, I:]
    grad_act = weight[:valid, None] * da[:valid]
    sig = torch.sigmoid(gate)
    want_gate = grad_act * up * sig * (1 + gate * (1 - sig))
    want_up = grad_act * F.silu(gate)
    torch.testing.assert_close(dh[:valid, :I], want_gate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh[:valid, I:], want_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        d_weight[:valid], (da[:valid] * F.silu(gate) * up).sum(1), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(dh[valid:], torch.zeros_like(dh[valid:])), "dh's padding rows"
    assert torch.equal(d_weight[valid:], torch.zeros_like(d_weight[valid:])), "d_weight's padding rows"
