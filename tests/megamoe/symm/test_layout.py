"""The device-side layout of the fused multi-GPU path, from random count matrices (pure torch, CPU).

Every rank computes its own tables from the same counts; the test checks they agree with each other:
each source's rows land on the owner of their expert at the rows whose recorded origin is that
source and send position, expert segments are contiguous, and the tile table covers them exactly.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.symm.layout import build_layout


def _layouts(C: torch.Tensor, G: int, pool_rows: int, block_m: int):
    W = C.shape[0]
    return [
        build_layout(C.to(torch.int32), rank=r, num_local_experts=G, pool_rows=pool_rows, block_m=block_m)
        for r in range(W)
    ]


@pytest.mark.parametrize(("W", "G", "seed"), [(2, 3, 0), (4, 2, 1), (8, 4, 2), (2, 1, 3)])
def test_every_row_lands_where_its_destination_expects_it(W: int, G: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    E = W * G
    C = torch.randint(0, 7, (W, E), generator=g)
    C[0] = 0  # a rank with no tokens
    C[:, 1] = 0  # an expert nobody routes to
    pool_rows = int(C.sum(0).view(W, G).sum(1).max()) + 5
    lays = _layouts(C, G, pool_rows, block_m=4)
    for s in range(W):
        send_start = torch.cat([torch.zeros(1, dtype=torch.long), C[s].cumsum(0)])
        for e in range(E):
            d = e // G
            for j in range(int(C[s, e])):
                row = int(lays[s].send_dest_row_E[e]) + j
                assert int(lays[d].row_src_R[row]) == s
                assert int(lays[d].row_pos_R[row]) == int(send_start[e]) + j
    for d, lay in enumerate(lays):
        mine = C[:, d * G : (d + 1) * G].sum(0)
        start = torch.cat([torch.zeros(1, dtype=torch.long), mine.cumsum(0)])
        assert lay.expert_start_G1.tolist() == start.tolist()
        assert int(lay.received_rows_1) == int(mine.sum())
        covered = []
        for t in range(int(lay.num_tiles_1)):
            expert, r0, r_end = lay.tiles_X3[t].tolist()
            assert start[expert] <= r0 < r_end <= start[expert + 1]
            covered += [r for r in range(r0, min(r0 + 4, r_end))]
        assert covered == list(range(int(mine.sum())))
        assert (lay.tiles_X3[int(lay.num_tiles_1) :, 0] == -1).all()


def test_rows_past_the_pool_are_clamped_and_reported() -> None:
    C = torch.tensor([[5, 4], [3, 2]])  # W = 2, G = 1: rank 0 receives 8 rows
    lay = _layouts(C, 1, pool_rows=6, block_m=4)[0]
    assert int(lay.received_rows_1) == 8
    assert lay.expert_start_G1.tolist() == [0, 6]
