"""The workspace's size bound: the capacity factor caps the pool (and every per-layer row tensor)."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.symm.workspace import BufferLayout, WorkspaceKey

DEEPSEEK = WorkspaceKey("ep", topk=8, num_experts=256, hidden=7168, dtype=torch.bfloat16)


def _pool_rows(world: int, factor: float, max_tokens: int = 8192) -> int:
    key = WorkspaceKey("ep", DEEPSEEK.topk, 32 * world, DEEPSEEK.hidden, DEEPSEEK.dtype)
    return BufferLayout.build(key, world, max_tokens, factor).pool_rows


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_default_holds_twice_a_balanced_share_and_max_the_worst_case(world) -> None:
    share = 8192 * 8  # T_max * top-k: what one rank receives under balanced routing
    assert _pool_rows(world, 2.0) == min(2, world) * share
    assert _pool_rows(world, float("inf")) == world * share  # every row of every rank to one rank
    assert _pool_rows(world, 0.5) == share // 2


def test_the_pool_never_exceeds_the_worst_case_with_few_local_experts() -> None:
    key = WorkspaceKey("ep", topk=8, num_experts=8, hidden=64, dtype=torch.bfloat16)  # G = 2 < K
    assert BufferLayout.build(key, 4, 100, 2.0).pool_rows == 4 * 100 * 2
