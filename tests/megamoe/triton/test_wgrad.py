"""grouped_wgrad: the K-grouped weight gradient, ``dW[g] = P_g^T Q_g`` over each expert's rows."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from megamoe.backends.triton.configs import wgrad_config
from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton.wgrad import grouped_wgrad

CPU = torch.device("cpu")


def _plan(counts: list[int]) -> RoutingPlan:
    """A plan carrying only what the wgrad reads: the experts' row starts."""
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    empty = torch.empty(0, dtype=torch.int32)
    return RoutingPlan(
        num_tokens=int(starts[-1]), topk=1, num_experts=len(counts), block_m=16, row_slot_R=empty,
        row_token_R=empty, slot_row_S=empty, expert_start_G1=starts, tiles_X3=empty.view(0, 3),
        num_tiles_1=empty,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("M", "N"),
    [
        (80, 48),  # 5 x 3 tiles of 16 x 16 per expert, 4 programs: descriptors kept across tiles
        (32, 16),  # 2 tiles per expert: every tile builds its own
    ],
)
def test_ragged_experts_match_the_reference(M: int, N: int) -> None:
    """Ragged row counts (a short last chunk, an expert with no rows, one shorter than a chunk), where
    a program runs several tiles of one expert in a row and then moves to another expert, and where
    each of its tiles is another expert's: each tile must read its own expert's rows only, and an
    empty expert gets zeros."""
    counts = [37, 0, 16, 5, 50]
    g = torch.Generator().manual_seed(0)
    p = torch.randn(sum(counts), M, generator=g)
    q = torch.randn(sum(counts), N, generator=g)
    out = torch.full((len(counts), M, N), float("nan"))
    grouped_wgrad(p, q, out, _plan(counts), config=wgrad_config(CPU), num_sms=4)
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    expected = torch.stack([p[a:b].T @ q[a:b] for a, b in pairwise(starts)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_a_column_slice_of_the_output_gets_the_same_values() -> None:
    """dW1 is written in column chunks: the wgrad into ``out[:, :, a:b]`` of a wider weight writes those
    columns (the same values as into a contiguous output) and nothing beside them."""
    counts = [9, 0, 21]
    g = torch.Generator().manual_seed(1)
    p = torch.randn(sum(counts), 32, generator=g)
    q = torch.randn(sum(counts), 40, generator=g)
    whole = torch.full((len(counts), 32, 72), float("nan"))
    alone = torch.empty(len(counts), 32, 40)
    grouped_wgrad(p, q, whole[:, :, 16:56], _plan(counts), config=wgrad_config(CPU), num_sms=4)
    grouped_wgrad(p, q, alone, _plan(counts), config=wgrad_config(CPU), num_sms=4)
    assert torch.equal(whole[:, :, 16:56], alone)
    assert whole[:, :, :16].isnan().all() and whole[:, :, 56:].isnan().all()
