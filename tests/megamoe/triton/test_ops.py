"""The expert-path ops' routing-weight moves (under TRITON_INTERPRET=1 on CPU): GEMM1's programs pick each
row's weight and ``dx``'s combine carries the weight gradient back to the slots, writing what the
stand-alone ``pick_rows`` and ``pick_slots`` launches write (zeros for dropped slots); without ``dx``
the backend picks the gradient alone."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton import ops
from megamoe.backends.triton.backend import TritonBackend
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton.rows import LocalRows, LocalTransport

CASES = [(13, 3, 4, 0.3), (0, 2, 3, 0.0), (6, 2, 3, 1.0)]
IDS = ["ragged-drops", "no-tokens", "all-dropped"]
H, I = 16, 8


def _case(T: int, K: int, G: int, drop: float):
    g = torch.Generator().manual_seed(T + G)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    plan = build_routing_plan(idx, num_experts=G, block_m=16)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(G, 2 * I, H, generator=g)
    values = torch.rand(T, K, generator=g) + 1  # never zero: a zero out means "dropped"
    return plan, x, w1, values


@pytest.mark.parametrize(("T", "K", "G", "drop"), CASES, ids=IDS)
def test_gemm1_forward_picks_each_rows_routing_weight(T: int, K: int, G: int, drop: float) -> None:
    plan, x, w1, values = _case(T, K, G, drop)
    *_, weights_R = ops.gemm1_forward(x, w1, values.view(-1), plan.row_slot_R, K, *plan.kernel_tables())
    assert torch.equal(weights_R, plan.row_values_R(values))


@pytest.mark.parametrize(("T", "K", "G", "drop"), CASES, ids=IDS)
def test_gemm1_backward_carries_the_weight_gradient_to_the_slots_with_dx(
    T: int, K: int, G: int, drop: float
) -> None:
    plan, x, w1, values = _case(T, K, G, drop)
    grad_R = plan.row_values_R(values) * 3
    grad_h = torch.randn(T * K, 2 * I)
    dx, _, d_weights = ops.gemm1_backward(x, w1, grad_h, grad_R, True, False, True, K, *plan.kernel_tables())
    assert torch.equal(d_weights, plan.slot_values_TK(grad_R).view(-1))
    assert dx.shape == (T, H)
    with pytest.raises(ValueError, match="need_dx too"):
        ops.gemm1_backward(x, w1, grad_h, grad_R, False, True, True, K, *plan.kernel_tables())


@pytest.mark.parametrize(
    ("need_dx", "need_dw1"),
    [(True, True), (False, True), (False, False)],
    ids=["with-dx", "dw1-only", "alone"],
)
@pytest.mark.parametrize(("T", "K", "G", "drop"), CASES, ids=IDS)
def test_stage1_backward_returns_the_weight_gradient_at_the_slots(
    T: int, K: int, G: int, drop: float, need_dx: bool, need_dw1: bool
) -> None:
    """Carried by dx's combine when dx is asked for, else picked alone."""
    plan, x, w1, values = _case(T, K, G, drop)
    grad_R = plan.row_values_R(values) * 3
    grad_h = torch.randn(T * K, 2 * I)
    _, d_weights, _ = TritonBackend(LocalTransport()).stage1_backward(
        x, w1, LocalRows(plan), grad_h, grad_R, (need_dx, True, need_dw1)
    )
    assert torch.equal(d_weights, plan.slot_values_TK(grad_R))
