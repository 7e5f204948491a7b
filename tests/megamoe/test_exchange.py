"""The NCCL/gloo token exchange (:mod:`megamoe.backends.exchange`) on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks


def _round_trip_rank(rank: int, world: int, tokens: tuple[int, ...], dtype: torch.dtype) -> bool:
    import torch.distributed as dist

    from megamoe.backends.exchange import TokenExchange

    g = torch.Generator().manual_seed(rank)
    T, H, E, K = tokens[rank], 8, 4, 2
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.randint(0, E, (T, K), generator=g)
    ex = TokenExchange.build(idx, num_experts=E, group=dist.group.WORLD)
    rows = ex.dispatch_tokens(x)
    back = ex.combine_tokens(rows, acc_dtype=torch.float32)  # each token comes back K times
    return rows.dtype == dtype and torch.equal(back, K * x.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rank_without_tokens_exchanges_rows_of_any_dtype(tmp_path, dtype) -> None:
    """bf16 travels as bytes (gloo has none); a rank with no rows must not break that reshape."""
    assert all(run_ranks(_round_trip_rank, 2, tmp_path, (5, 0), dtype))
