"""The device-side layout of the fused multi-GPU path, from random count matrices (the layout kernel
under ``TRITON_INTERPRET=1`` on the CPU).

Every rank computes its own tables from the same counts; the test checks they agree with each other:
each source's rows land on the owner of their expert at the rows whose recorded origin is that
source and send position, expert segments are contiguous, the owner's own rows lead each expert, and
the tile table covers them exactly, the tiles of only own rows first.
And every table equals the direct torch formulas below (the kernel's definition), clamped pools and
the epoch's count bank included.
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
        src = lay.row_src_R.tolist()
        for g in range(G):  # the destination's own rows lead each expert
            origins = src[start[g] : start[g + 1]]
            assert origins == sorted(origins, key=lambda s: (s - d) % W)
        covered, local_only = [], []
        for t in range(int(lay.num_tiles_1)):
            expert, r0, r_end = lay.tiles_X3[t].tolist()
            assert start[expert] <= r0 < r_end <= start[expert + 1]
            covered += [r for r in range(r0, min(r0 + 4, r_end))]
            local_only.append(all(src[r] == d for r in range(r0, min(r0 + 4, r_end))))
        assert sorted(covered) == list(range(int(mine.sum())))
        assert local_only == sorted(local_only, reverse=True), "the tiles of own rows come first"
        assert (lay.tiles_X3[int(lay.num_tiles_1) :, 0] == -1).all()


def test_rows_past_the_pool_are_clamped_and_reported() -> None:
    C = torch.tensor([[5, 4], [3, 2]])  # W = 2, G = 1: rank 0 receives 8 rows
    lay = _layouts(C, 1, pool_rows=6, block_m=4)[0]
    assert int(lay.received_rows_1) == 8
    assert lay.expert_start_G1.tolist() == [0, 6]


def _reference(C: torch.Tensor, rank: int, G: int, P: int, block_m: int) -> dict[str, torch.Tensor]:
    """The layout in plain torch: the definition the kernel must reproduce, every table, every row."""
    W, E = C.shape
    C = C.long()
    ranks = torch.arange(W)
    total_DG = C.sum(0).view(W, G)
    # on destination d the sources come in the order d, d+1, ..., d-1
    ahead_of_me_SD = (ranks[:, None] - ranks[None, :]) % W < (rank - ranks[None, :]) % W
    from_ahead_DG = (C.view(W, W, G) * ahead_of_me_SD[:, :, None]).sum(0)
    send_dest_row_E = (total_DG.cumsum(1) - total_DG + from_ahead_DG).reshape(E)
    mine_WG = C[:, rank * G : (rank + 1) * G]
    end_G = mine_WG.sum(0).cumsum(0).clamp(max=P)
    expert_start_G1 = torch.cat([end_G.new_zeros(1), end_G])
    start_G = expert_start_G1[:-1]
    order_W = (ranks + rank) % W  # my pool's source order
    in_order_GW = mine_WG[order_W].t()
    seg_start_in_order_GW = start_G[:, None] + in_order_GW.cumsum(1) - in_order_GW
    seg_start_GW = torch.empty_like(seg_start_in_order_GW)
    seg_start_GW[:, order_W] = seg_start_in_order_GW
    seg_len_GW = mine_WG.t()
    send_base_GW = (C.cumsum(1) - C)[:, rank * G : (rank + 1) * G].t()
    rows = torch.arange(P)
    seg = (torch.searchsorted(seg_start_in_order_GW.reshape(-1), rows, right=True) - 1).clamp(min=0)
    seg_g, seg_s = seg // W, order_W[seg % W]
    # tiles: first those holding only my rows (they lead each expert), then the rest
    rows_G = end_G - start_G
    tiles_G = (rows_G + block_m - 1) // block_m
    local_end_G = torch.minimum(start_G + mine_WG[rank], end_G)
    local_G = torch.where(local_end_G == end_G, tiles_G, (local_end_G - start_G) // block_m)
    tiles = [(g, int(start_G[g]) + j * block_m, int(end_G[g])) for g in range(G) for j in range(local_G[g])]
    tiles += [
        (g, int(start_G[g]) + j * block_m, int(end_G[g]))
        for g in range(G)
        for j in range(local_G[g], tiles_G[g])
    ]
    capacity = -(-P // block_m) + G
    tiles += [(-1, 0, 0)] * (capacity - len(tiles))
    return {
        "send_dest_row_E": send_dest_row_E,
        "expert_start_G1": expert_start_G1,
        "tiles_X3": torch.tensor(tiles),
        "num_tiles_1": tiles_G.sum().reshape(1),
        "num_local_tiles_1": local_G.sum().reshape(1),
        "row_src_R": seg_s,
        "row_pos_R": send_base_GW[seg_g, seg_s] + rows - seg_start_GW[seg_g, seg_s],
        "received_rows_1": mine_WG.sum().reshape(1),
        "seg_start_GW": seg_start_GW.reshape(-1),
        "seg_len_GW": seg_len_GW.reshape(-1),
        "seg_pos_GW": send_base_GW.reshape(-1),
    }


@pytest.mark.parametrize(
    ("W", "G", "slack", "seed"),
    [
        (2, 3, 5, 0),
        (4, 2, 0, 1),
        (8, 4, 3, 2),
        (2, 1, 1, 3),
        pytest.param(8, 32, 7, 4, marks=pytest.mark.slow),
        (3, 5, -6, 5),
        (1, 4, 0, 6),
    ],
    ids=["ep2", "ep4", "ep8", "one-expert", "ep8-32-experts", "ep3-clamped", "one-rank"],
)
def test_the_kernel_equals_the_torch_definition(W: int, G: int, slack: int, seed: int) -> None:
    """Every output, every row and tile (padding included), at every rank; ``slack < 0`` clamps the pool;
    the counts come from the bank the epoch's parity picks."""
    g = torch.Generator().manual_seed(seed)
    E = W * G
    banks = torch.randint(0, 9, (2, W, E), generator=g).to(torch.int32)
    banks[1, 0] = 0  # a rank with no tokens
    if G > 1:
        banks[1, :, 1] = 0  # an expert nobody routes to
    C = banks[1]
    pool_rows = max(1, int(C.sum(0).view(W, G).sum(1).max()) + slack)
    for rank in range(W):
        lay = build_layout(
            banks, rank=rank, num_local_experts=G, pool_rows=pool_rows, block_m=4, epoch_1=torch.tensor([7])
        )
        for name, want in _reference(C, rank, G, pool_rows, block_m=4).items():
            assert getattr(lay, name).tolist() == want.tolist(), f"rank {rank}: {name}"
