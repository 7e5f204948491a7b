"""The quantising SwiGLU passes (``swiglu_quant``) in both formats, blockwise FP8 (128-element tiles) and
MX (32-element blocks), against the formula: the routed rows' gradients, the quantised operands
dequantised, and the padding rows (dropped slots) zeroed by the backward's own launch.

Runs under ``TRITON_INTERPRET=1`` on the CPU (float32) and on a GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton_fp8 import swiglu as fp8_swiglu
from megamoe.backends.triton_fp8.experts import FP8Experts
from megamoe.backends.triton_mx import swiglu as mx_swiglu
from megamoe.backends.triton_mx.experts import MXExperts
from megamoe.quant.mx import e8m0_to_float
from tests.megamoe.triton_mx.test_quantize import DEVICE


@dataclass(frozen=True)
class Format:
    name: str
    tile: int
    passes: ModuleType
    row_plan: object

    def scales(self, scale: Tensor) -> Tensor:
        return scale.float() if self.name == "fp8" else e8m0_to_float(scale)


FORMATS = [
    Format("fp8", 128, fp8_swiglu, FP8Experts.row_plan),
    Format("mxfp8", 32, mx_swiglu, MXExperts.row_plan),
]


def _dequantized(data: Tensor, scale: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
    """(values, each value's tile scale) of tiles along dim 1."""
    per_value = fmt.scales(scale).repeat_interleave(fmt.tile, dim=1)[:, : data.shape[1]]
    return data.float() * per_value, per_value


def _assert_quantized_close(got: Tensor, scale: Tensor, want: Tensor) -> None:
    """E4M3 keeps 3 mantissa bits: within 1/16 of each value, or one subnormal step of its tile."""
    bound = want.abs() / 16 + scale * 2.0**-9
    assert ((got - want).abs() <= bound * 1.001 + 1e-6).all(), (got - want).abs().max()


def _routed(T: int, K: int, G: int, drop: float, fmt: Format, g: torch.Generator):
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    return fmt.row_plan(build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=16))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(
    ("T", "K", "G", "I", "drop"),
    [(40, 2, 3, 48, 0.0), (100, 4, 3, 32, 0.9), (9, 2, 4, 16, 1.0)],
    ids=["nothing-dropped", "most-dropped-several-programs-zero", "all-dropped"],
)
def test_swiglu_backward_writes_routed_rows_quantizes_w_a_and_zeroes_padding_rows(
    fmt: Format, T: int, K: int, G: int, I: int, drop: float
) -> None:
    g = torch.Generator().manual_seed(0)
    plan = _routed(T, K, G, drop, fmt, g)
    R = T * K
    h = torch.randn(R, 2 * I, generator=g).to(DEVICE)
    da = torch.randn(R, I, generator=g).to(DEVICE)
    weight = torch.rand(R, generator=g).to(DEVICE)
    dh = torch.full((R, 2 * I), float("nan"), device=DEVICE)
    d_weight = torch.full((R,), float("nan"), device=DEVICE)

    r = plan.routing
    aw = fmt.passes.swiglu_backward_quant(
        h, da, weight, dh, d_weight, r.expert_start_G1, plan.block_start_G1, plan.num_blocks
    )

    valid = int(r.expert_start_G1[-1])
    gate, up = h[:valid, :I], h[:valid, I:]
    grad_act = weight[:valid, None] * da[:valid]
    sig = torch.sigmoid(gate)
    torch.testing.assert_close(
        dh[:valid, :I], grad_act * up * sig * (1 + gate * (1 - sig)), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(dh[:valid, I:], grad_act * F.silu(gate), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        d_weight[:valid], (da[:valid] * F.silu(gate) * up).sum(1), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(dh[valid:], torch.zeros_like(dh[valid:])), "dh's padding rows"
    assert torch.equal(d_weight[valid:], torch.zeros_like(d_weight[valid:])), "d_weight's padding rows"

    # w a packed along R: expert e's rows from column tile * block_start[e], zeros to its blocks' end
    row_start, block_start = r.expert_start_G1.cpu().tolist(), plan.block_start_G1.cpu().tolist()
    w_a = (weight[:, None] * F.silu(h[:, :I]) * h[:, I:]).cpu()
    want = torch.zeros(I, fmt.tile * block_start[-1])
    for e in range(G):
        rows = row_start[e + 1] - row_start[e]
        want[:, fmt.tile * block_start[e] :][:, :rows] = w_a[row_start[e] : row_start[e + 1]].T
    got, scale = _dequantized(aw.data[:, : want.shape[1]].cpu(), aw.scale[:, : block_start[-1]].cpu(), fmt)
    _assert_quantized_close(got, scale, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("I", [16, 160], ids=["one-partial-tile", "two-tiles-the-second-partial"])
def test_swiglu_quant_quantizes_the_valid_rows_along_i(fmt: Format, I: int) -> None:
    g = torch.Generator().manual_seed(1)
    plan = _routed(30, 2, 3, 0.3, fmt, g)
    h = torch.randn(60, 2 * I, generator=g).to(DEVICE)

    a = fmt.passes.swiglu_quant(h, plan.valid_rows_1)

    valid = int(plan.valid_rows_1)
    got, scale = _dequantized(a.data[:valid].cpu(), a.scale[:valid].cpu(), fmt)
    want = (F.silu(h[:valid, :I]) * h[:valid, I:]).cpu()
    _assert_quantized_close(got, scale, want)
