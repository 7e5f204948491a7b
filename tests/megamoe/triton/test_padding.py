"""``zero_padding_rows`` (on a GPU, or under TRITON_INTERPRET=1 on CPU): rows past the routed ones become zeros, the
routed ones are untouched, and with ``row_values`` the same launch writes what ``pick_rows`` writes (the
quantised GEMM1s' routing weights)."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton.padding import zero_padding_rows
from megamoe.backends.triton.routing import build_routing_plan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

CASES = [(13, 3, 4, 0.3, 24), (0, 2, 3, 0.0, 24), (6, 2, 3, 1.0, 24), (40, 2, 5, 0.1, 300), (9, 2, 3, 0.3, 0)]
IDS = ["ragged-drops", "no-tokens", "all-dropped", "several-blocks-wide-rows", "no-columns"]


@pytest.mark.parametrize("pick", [False, True], ids=["zero-only", "and-pick"])
@pytest.mark.parametrize(("T", "K", "G", "drop", "N"), CASES, ids=IDS)
def test_zero_padding_rows(T: int, K: int, G: int, drop: float, N: int, pick: bool) -> None:
    g = torch.Generator().manual_seed(T + G + N)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    plan = build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=16)
    valid = int(plan.expert_start_G1[-1])
    a = torch.randn(T * K, N, generator=g).to(DEVICE)
    b = torch.randn(T * K, N // 2, generator=g).to(DEVICE)
    before = a.clone(), b.clone()
    values = (torch.rand(T * K, generator=g) + 1).to(DEVICE)  # never zero: a zero out means "dropped"
    out = torch.full((T * K,), float("nan"), device=DEVICE)
    zero_padding_rows(plan.expert_start_G1, a, b, row_values=(values, plan.row_slot_R, out) if pick else None)
    assert torch.equal(a[:valid], before[0][:valid]) and torch.equal(b[:valid], before[1][:valid])
    assert not a[valid:].any() and not b[valid:].any()
    if pick:
        assert torch.equal(out, plan.row_values_R(values.view(T, K)))
