"""The workspace's size bound: the capacity factor caps the pool (and every per-layer row tensor)."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.symm.workspace import BufferLayout, WorkspaceKey, capacity_factor
from megamoe.errors import InvalidConfigError

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


@pytest.mark.parametrize(("raw", "expected"), [(None, 2.0), ("3", 3.0), ("1.5", 1.5), ("max", float("inf"))])
def test_capacity_factor_from_the_environment(monkeypatch, raw, expected) -> None:
    if raw is None:
        monkeypatch.delenv("MEGAMOE_SYMM_CAPACITY", raising=False)
    else:
        monkeypatch.setenv("MEGAMOE_SYMM_CAPACITY", raw)
    assert capacity_factor() == expected


@pytest.mark.parametrize("raw", ["0", "-1", "lots", "nan"])
def test_a_bad_capacity_factor_names_the_variable_and_the_fix(monkeypatch, raw) -> None:
    monkeypatch.setenv("MEGAMOE_SYMM_CAPACITY", raw)
    with pytest.raises(InvalidConfigError, match="MEGAMOE_SYMM_CAPACITY") as err:
        capacity_factor()
    assert "MEGAMOE_SYMM_CAPACITY=max" in str(err.value)
