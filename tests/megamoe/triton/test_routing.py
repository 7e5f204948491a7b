"""Device routing tables (run under TRITON_INTERPRET=1 on CPU): a stable counting sort plus tile table."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton import routing
from megamoe.backends.triton.routing import build_routing_plan


@pytest.fixture(params=["one-program", "four-launches"])
def plan_path(request, monkeypatch) -> str:
    """Each test below runs over both ways of building the plan: one program for few slots, else the
    four multi-program passes (forced here by a zero threshold)."""
    if request.param == "four-launches":
        monkeypatch.setattr(routing, "ONE_PROGRAM_CELLS", 0)
    return request.param


def _expected(idx_TK: torch.Tensor, G: int, block_m: int):
    flat = idx_TK.reshape(-1)
    key = torch.where((flat >= 0) & (flat < G), flat, G)
    order = torch.argsort(key, stable=True)
    start = torch.zeros(G + 1, dtype=torch.long)
    start[1:] = torch.bincount(key, minlength=G + 1)[:G].cumsum(0)
    tiles = [
        (e, r, int(start[e + 1])) for e in range(G) for r in range(int(start[e]), int(start[e + 1]), block_m)
    ]
    return order, start, tiles


@pytest.mark.parametrize(
    ("T", "K", "G", "drop"),
    [(37, 3, 5, 0.2), (64, 8, 16, 0.0), (0, 2, 3, 0.0), (50, 2, 1, 0.5), (20, 4, 9, 1.0), (150, 4, 40, 0.1)],
    ids=[
        "ragged",
        "top8-16experts",
        "no-tokens",
        "one-expert",
        "all-dropped",
        "40-experts-4-offset-programs",
    ],
)
def test_routing_plan_sorts_stably_and_tiles_every_expert(
    T: int, K: int, G: int, drop: float, plan_path: str
) -> None:
    g = torch.Generator().manual_seed(T + G)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    plan = build_routing_plan(idx, num_experts=G, block_m=16)
    order, start, tiles = _expected(idx, G, 16)
    assert torch.equal(plan.row_slot_R.long(), order)
    assert torch.equal(plan.row_token_R.long(), order // K)
    assert torch.equal(plan.expert_start_G1.long(), start)
    used = int(plan.num_tiles_1)
    assert [tuple(t) for t in plan.tiles_X3[:used].tolist()] == tiles
    assert (plan.tiles_X3[used:, 0] == -1).all()
    valid = plan.slot_row_S >= 0
    assert torch.equal(valid, idx.reshape(-1) >= 0)
    assert torch.equal(plan.row_slot_R.long()[plan.slot_row_S[valid].long()], torch.arange(T * K)[valid])


@pytest.mark.parametrize(
    ("T", "K", "G", "drop"), [(37, 3, 5, 0.2), (0, 2, 3, 0.0), (20, 4, 9, 1.0), (700, 2, 4, 0.1)]
)
def test_row_and_slot_values_move_each_value_and_zero_the_dropped(
    T: int, K: int, G: int, drop: float, plan_path: str
) -> None:
    """The per-slot scalars (routing weights forward, their gradient backward) in row order and back;
    700 x 2 slots take two launch blocks."""
    g = torch.Generator().manual_seed(T)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    plan = build_routing_plan(idx, num_experts=G, block_m=16)
    values = torch.rand(T, K, generator=g) + 1  # never zero: a zero out means "dropped"
    order, start, _ = _expected(idx, G, 16)
    valid = int(start[G])
    rows = plan.row_values_R(values)
    expected = values.reshape(-1)[order].clone()
    expected[valid:] = 0
    assert torch.equal(rows, expected)
    back = plan.slot_values_TK(rows)
    assert back.shape == (T, K)
    assert torch.equal(back, torch.where(idx >= 0, values, torch.zeros_like(values)))


@pytest.mark.parametrize("bad", [4, 100, -2, 2**33], ids=["E", "far-above", "below-minus-one", "wraps-int32"])
def test_check_ids_fails_on_an_id_outside_the_experts_and_the_plan_treats_it_as_dropped(
    bad: int, plan_path: str
) -> None:
    """The plan counts invalid ids in a bin of their own; ``check_ids`` asserts there were none (on CPU
    the assert is synchronous: a RuntimeError)."""
    idx = torch.tensor([[0, 3], [-1, 2], [1, 0]])
    build_routing_plan(idx, num_experts=4, block_m=16, check_ids=True)  # valid ids (and -1) pass
    idx[1, 1] = bad
    with pytest.raises(RuntimeError, match=r"expert ids must be in \[0, 4\) or -1"):
        build_routing_plan(idx, num_experts=4, block_m=16, check_ids=True)
    plan = build_routing_plan(idx, num_experts=4, block_m=16)
    assert plan.slot_row_S[3] == -1  # the bad slot: no row, like a dropped one
    assert plan.expert_start_G1.tolist() == [0, 2, 3, 3, 4]
